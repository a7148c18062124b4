"""Start, stop, kill and restart a real ``ems-server`` subprocess (see ``ems.testing``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence

from ems.testing.process import ChildProcess

if TYPE_CHECKING:
    from ems.protocol.report import DiskReport

__all__ = ["ServerProcess", "disk_after_recovery", "run_server"]

_SOCK_PATH_MAX = 100  # unix socket paths are limited to 107 bytes


class ServerProcess(ChildProcess):
    """A daemon subprocess; ``directory`` holds its log and files, ``socket_dir`` its
    socket (a short directory under the system temp dir when ``directory`` is deep)."""

    def __init__(self, directory: str, socket_dir: str, args: Sequence[str],
                 env: Optional[Mapping[str, str]] = None,
                 nofile: Optional[int] = None, netns: Optional[str] = None) -> None:
        from ems.client.singleton import SOCKET_NAME
        super().__init__("ems.server", os.path.join(directory, "ems-server.log"), env)
        self.directory = directory
        self.socket_dir = socket_dir
        self.socket_path = os.path.join(socket_dir, SOCKET_NAME)
        self.args = list(args)
        #: RLIMIT_NOFILE of the daemon (tests of fd pressure); None: inherited
        self.nofile = nofile
        #: the network namespace the daemon runs in (``ip netns exec``, which execs:
        #: the pid is the daemon's); None: this process's
        self.netns = netns

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 15.0) -> "ServerProcess":
        """Start the daemon and wait until its socket accepts connections."""
        nofile = self.nofile or 0

        def limit() -> None:  # in the child, before exec
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        proc = self.spawn(["--socket-dir", self.socket_dir, *self.args],
                          preexec_fn=limit if self.nofile is not None else None,
                          wrap=["ip", "netns", "exec", self.netns] if self.netns else ())
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                code = proc.returncode
                self._close_log()
                raise RuntimeError(f"ems-server exited with {code} at start:\n{self.log()}")
            if self._accepts():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"ems-server did not listen within {timeout_s} s:\n"
                                   f"{self.log()}")
            time.sleep(0.02)

    def restart(self, timeout_s: float = 15.0) -> "ServerProcess":
        """Stop (gracefully) if running, then start a new daemon on the same socket."""
        self.stop()
        return self.start(timeout_s)

    # ------------------------------------------------------------ queries
    def client_env(self) -> dict[str, str]:
        """What an SDK process needs in its environment to use this daemon."""
        return {"EMS_POOL": "server", "EMS_SOCKET_DIR": self.socket_dir}

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The daemon's statistics report (every tenant)."""
        from ems.client.remote import server_report
        return server_report(self.socket_path, timeout_s)

    def disk_after_recovery(self, timeout_s: float = 60.0) -> "DiskReport":
        """The disk tier's report once this start's recovery has ended (see
        :func:`disk_after_recovery`)."""
        return disk_after_recovery(self.socket_path, timeout_s)

    def _accepts(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(0.5)
        try:
            s.connect(self.socket_path)
            return True
        except OSError:
            return False
        finally:
            s.close()


def disk_after_recovery(socket_path: str, timeout_s: float = 60.0) -> "DiskReport":
    """The disk tier's report of the daemon on ``socket_path`` once its start's recovery
    has ended.

    The daemon accepts connections before its disk is recovered (a load meanwhile waits
    for the recovery): a report taken right after a start may still say
    ``recovering``, with no record found yet. Polls every 20 ms; RuntimeError after
    ``timeout_s``, or when the daemon runs without ``--disk``.
    """
    from ems.client.remote import server_report
    from ems.protocol.report import DaemonReport
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.1, deadline - time.monotonic())
        disk = DaemonReport.from_wire(server_report(socket_path, left)).disk
        if disk is None:
            raise RuntimeError(f"the daemon on {socket_path} has no disk tier")
        if disk.state != "recovering":
            return disk
        if time.monotonic() > deadline:
            raise RuntimeError(f"the disk of the daemon on {socket_path} was still "
                               f"recovering after {timeout_s} s")
        time.sleep(0.02)


def write_tenants_file(path: str, tenants: Mapping[str, str]) -> str:
    """Write a tenants file (mode 0600) of ``access_id -> access_key``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("[tenants]\n")
        for ident, key in tenants.items():
            f.write(f'"{ident}" = "{key}"\n')
    os.chmod(path, 0o600)
    return path


@contextlib.contextmanager
def run_server(directory: Optional[str] = None, *, capacity: str = "64M",
               tenants: Optional[Mapping[str, str]] = None, anonymous: bool = True,
               quotas: Optional[Mapping[str, str]] = None,
               reservation_ttl_s: Optional[float] = None, log_level: Optional[str] = None,
               extra_args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
               start: bool = True, start_timeout_s: float = 15.0,
               nofile: Optional[int] = None, netns: Optional[str] = None
               ) -> Iterator[ServerProcess]:
    """Run an ``ems-server`` for the duration of the block; always stop it.

    ``directory`` (default: a new temp dir, removed afterwards) receives the log and
    the tenants file; ``tenants`` maps access_id to access_key; ``quotas`` access_id
    to a size. ``start=False`` hands back a configured, unstarted server. ``nofile``
    sets the daemon's RLIMIT_NOFILE (tests of fd pressure); ``netns`` runs it in that
    network namespace (``ems.testing.netns``).
    """
    cleanup: list[str] = []
    if directory is None:
        directory = tempfile.mkdtemp(prefix="ems-test-")
        cleanup.append(directory)
    socket_dir = os.path.join(directory, "sock")
    if len(os.fsencode(socket_dir)) > _SOCK_PATH_MAX - 10:
        socket_dir = tempfile.mkdtemp(prefix="ems-sock-")
        cleanup.append(socket_dir)
    args = ["--capacity", str(capacity)]
    if log_level is not None:
        args += ["--log-level", log_level]
    args.append("--anonymous" if anonymous else "--no-anonymous")
    if tenants:
        args += ["--tenants-file",
                 write_tenants_file(os.path.join(directory, "tenants.toml"), tenants)]
    for ident, size in (quotas or {}).items():
        args += ["--quota", f"{ident}={size}"]
    if reservation_ttl_s is not None:
        args += ["--reservation-ttl-s", str(reservation_ttl_s)]
    args += list(extra_args)
    server = ServerProcess(directory, socket_dir, args, env, nofile, netns)
    try:
        if start:
            server.start(start_timeout_s)
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            try:
                server.resume()  # a paused daemon cannot handle SIGTERM
            except (OSError, AssertionError):
                pass
        server.stop()
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
