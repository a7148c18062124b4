"""One handle for a child process of ours (``ems-server``, ``ems-control``): started
from this very ``ems`` (also from a source tree that is not installed), its output in
a log file, in a session of its own, and stopped by its PID.

The daemon's :class:`~ems.testing.server.ServerProcess` and the control plane's
:class:`~ems.testing.control.ControlProcess` are this handle plus what each needs to
know that it is up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["ChildProcess", "terminate"]


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


def _source_root() -> str:
    """The directory that holds this ``ems`` package (``src/`` in a checkout)."""
    import ems
    return os.path.dirname(os.path.dirname(os.path.abspath(str(ems.__file__))))


class ChildProcess:
    """``python -m MODULE ARGS`` with its output appended to ``log_path``."""

    def __init__(self, module: str, log_path: str,
                 env: Optional[Mapping[str, str]] = None) -> None:
        self.module = module
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_source_root(), self.env.get("PYTHONPATH", "")) if p)
        self.proc: Optional[subprocess.Popen] = None
        self._log: Any = None

    def spawn(self, args: Sequence[str], preexec_fn: Optional[Callable[[], None]] = None,
              wrap: Sequence[str] = ()) -> subprocess.Popen:
        """Start the child (not waiting for anything). ``wrap``: a command that execs
        it (``ip netns exec NS``), so the pid is still the child's."""
        if self.running:
            raise RuntimeError(f"{self.module} is already running")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", self.module, *args],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=self.env, start_new_session=True, preexec_fn=preexec_fn)
        return self.proc

    def stop(self, timeout_s: float = 10.0) -> Optional[int]:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status
        (None if it never started)."""
        proc = self.proc
        if proc is None:
            return None
        code = terminate(proc, timeout_s)
        self._close_log()
        return code

    def signal(self, signum: int, timeout_s: float = 10.0) -> int:
        """Send ``signum`` and wait for the exit; its status (SIGKILL after
        ``timeout_s``, so a child that ignores the signal cannot hang a test)."""
        proc = self.proc
        assert proc is not None
        proc.send_signal(signum)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._close_log()
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._close_log()

    def pause(self) -> None:
        """SIGSTOP: the child hangs."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
