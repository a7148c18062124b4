"""Start, stop, kill and restart a real ``ems-server`` subprocess (see ``ems.testing``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

__all__ = ["ServerProcess", "run_server", "terminate"]

_SOCK_PATH_MAX = 100  # unix socket paths are limited to 107 bytes


def terminate(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """Stop a child by its PID: SIGTERM, then SIGKILL if it has not exited after
    ``timeout_s``; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class ServerProcess:
    """A daemon subprocess; ``directory`` holds its log and files, ``socket_dir`` its
    socket (a short directory under the system temp dir when ``directory`` is deep)."""

    def __init__(self, directory: str, socket_dir: str, args: Sequence[str],
                 env: Optional[Mapping[str, str]] = None,
                 nofile: Optional[int] = None, netns: Optional[str] = None) -> None:
        from ems.client.singleton import SOCKET_NAME
        self.directory = directory
        self.socket_dir = socket_dir
        self.socket_path = os.path.join(socket_dir, SOCKET_NAME)
        self.log_path = os.path.join(directory, "ems-server.log")
        self.args = list(args)
        self.env = dict(os.environ if env is None else env)
        # The daemon imports this very ems (also from a source tree that is not installed).
        src = os.path.dirname(os.path.dirname(os.path.abspath(str(__import__("ems").__file__))))
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (src, self.env.get("PYTHONPATH", "")) if p)
        self.proc: Optional[subprocess.Popen] = None
        self._log: Any = None
        #: RLIMIT_NOFILE of the daemon (tests of fd pressure); None: inherited
        self.nofile = nofile
        #: the network namespace the daemon runs in (``ip netns exec``, which execs:
        #: the pid is the daemon's); None: this process's
        self.netns = netns

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 15.0) -> "ServerProcess":
        """Start the daemon and wait until its socket accepts connections."""
        if self.running:
            raise RuntimeError("ems-server is already running")
        self._log = open(self.log_path, "ab")
        nofile = self.nofile or 0

        def limit() -> None:  # in the child, before exec
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        wrap = ["ip", "netns", "exec", self.netns] if self.netns else []
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "ems.server", "--socket-dir", self.socket_dir,
             *self.args],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=self.env, start_new_session=True,
            preexec_fn=limit if self.nofile is not None else None)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self._close_log()
                raise RuntimeError(f"ems-server exited with {code} at start:\n{self.log()}")
            if self._accepts():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"ems-server did not listen within {timeout_s} s:\n"
                                   f"{self.log()}")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> Optional[int]:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        code = terminate(proc, timeout_s)
        self._close_log()
        return code

    def kill(self) -> None:
        """SIGKILL (a crash: the socket file stays behind, stale)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._close_log()

    def pause(self) -> None:
        """SIGSTOP: the daemon hangs (its socket still accepts)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self, timeout_s: float = 15.0) -> "ServerProcess":
        """Stop (gracefully) if running, then start a new daemon on the same socket."""
        self.stop()
        return self.start(timeout_s)

    # ------------------------------------------------------------ queries
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client_env(self) -> dict[str, str]:
        """What an SDK process needs in its environment to use this daemon."""
        return {"EMS_POOL": "server", "EMS_SOCKET_DIR": self.socket_dir}

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The daemon's statistics report (every tenant)."""
        from ems.client.remote import server_report
        return server_report(self.socket_path, timeout_s)

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

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

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


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
