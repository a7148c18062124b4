"""Processes the bench starts (peers, daemons): started in their own session, always
stopped by PID, at the end of a run, on an error, on Ctrl-C or SIGTERM.

Nothing here ever looks a process up by name: the bench only stops what it started.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Callable, Optional, Sequence

__all__ = ["Service", "free_port", "wait_for", "install_signal_handlers"]

logger = logging.getLogger(__name__)

_started: dict[int, "Service"] = {}
_lock = threading.Lock()


class Service:
    """A child process with a log file; :meth:`stop` ends it and its process group."""

    def __init__(self, name: str, argv: Sequence[str], log_path: str,
                 env: Optional[dict[str, str]] = None, cwd: Optional[str] = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                         start_new_session=True)
        except BaseException:
            self._log.close()
            raise
        self.pid = self.proc.pid
        with _lock:
            _started[self.pid] = self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_bytes: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n_bytes))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM to the child's process group (it leads it), SIGKILL after ``timeout_s``."""
        with _lock:
            _started.pop(self.pid, None)
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.pid, sig)  # our child leads its own session: pgid == pid
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            try:  # children it left in its group
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()


def stop_all() -> None:
    """Stop every process the bench started and has not stopped yet (atexit, signals)."""
    with _lock:
        services = list(_started.values())
    for s in services:
        try:
            s.stop(timeout_s=2.0)
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.exception("bench: could not stop %s (pid %d)", s.name, s.pid)


atexit.register(stop_all)


def install_signal_handlers() -> Callable[[], None]:
    """Make SIGTERM/SIGHUP unwind like Ctrl-C (so ``finally`` blocks stop peers).
    Returns a function that restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.signal(sig, _raise) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return restore


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, ready: Callable[[], bool], service: Optional[Service],
             timeout_s: float = 20.0) -> None:
    """Poll ``ready()`` until true; raise RuntimeError (with the log tail) on timeout or
    when ``service`` died."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except Exception:  # noqa: BLE001 - not ready yet
            pass
        if service is not None and not service.alive():
            raise RuntimeError(f"{what} exited with code {service.proc.returncode}: "
                               f"{service.log_tail()}")
        if time.monotonic() > deadline:
            tail = service.log_tail() if service is not None else ""
            raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s. {tail}")
        time.sleep(0.05)
