"""CcResult and CcFuture: the results of requests, and the machinery that runs them.

A request runs on a worker thread of its ContextCaching. Its deadline
(``CcKvOption.timeout``) is enforced at *checkpoints* between copy steps: the worker
stops there, and a caller that gives up waiting first marks the request cancelled and
then waits for the worker to reach its next checkpoint. So when ``result()`` raises
``EMS_IO_TIMEOUT``, no byte will be written into the caller's buffers afterwards.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Optional

from ems.errors import EmsErrorCode, EmsException

__all__ = ["Cancelled", "CcFuture", "CcResult", "Task"]


class CcResult:
    """``success``: keys from the start of the batch that succeeded consecutively;
    ``total``: keys in the request."""

    __slots__ = ("success", "total")

    def __init__(self, success: int, total: int) -> None:
        self.success = success
        self.total = total

    def __repr__(self) -> str:
        return f"CcResult(success={self.success}, total={self.total})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CcResult) and self.success == other.success
                and self.total == other.total)

    def __hash__(self) -> int:
        return hash((self.success, self.total))


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class Cancelled(Exception):
    """Raised at a checkpoint when the request must stop (deadline or caller gave up)."""


class Task:
    """One request: its deadline, its cancellation flag and its outcome."""

    def __init__(self, timeout_ms: int, what: str, keys: Optional[int] = None) -> None:
        self._what = what
        self._keys = keys
        self.timeout_ms = timeout_ms
        self.deadline: Optional[float] = (
            time.monotonic() + timeout_ms / 1000.0 if timeout_ms > 0 else None)
        self._lock = threading.Lock()
        self._finished = False
        # Made only when somebody has to wait: a synchronous call runs its task in the
        # caller's thread and finds it finished, so it never pays for an Event.
        self._done: Optional[threading.Event] = None
        self._state = _State.QUEUED
        self._cancelled = False
        self._result: Optional[CcResult] = None
        self._error: Optional[EmsException] = None

    @property
    def what(self) -> str:
        """``save of 3 key(s)``: for messages (formatted only when one is needed)."""
        return self._what if self._keys is None else f"{self._what} of {self._keys} key(s)"

    # ----------------------------------------------------------- worker side
    def start(self) -> bool:
        """Worker picks the task up; False if it was cancelled while queued."""
        with self._lock:
            if self._state is not _State.QUEUED:
                return False
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._finish_locked(None, self.timeout_error())
                return False
            self._state = _State.RUNNING
            return True

    def checkpoint(self) -> None:
        """Between copy steps: raise :class:`Cancelled` past the deadline or on cancel."""
        if self._cancelled or (self.deadline is not None and time.monotonic() >= self.deadline):
            self._cancelled = True
            raise Cancelled

    def tighten(self, deadline: float) -> None:
        """Also stop by ``deadline`` (a monotonic time): e.g. a pool's reservation TTL,
        which bounds a save's copy even when the request itself has no deadline."""
        if self.deadline is None or self.deadline > deadline:
            self.deadline = deadline

    def remaining_s(self) -> Optional[float]:
        """Seconds left before the deadline (None: no deadline)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def decide(self) -> bool:
        """Last checkpoint before a result is published: True to publish, False if
        the request was cancelled (the caller then sees a timeout)."""
        with self._lock:
            if self._cancelled:
                return False
            self._state = _State.DONE  # from now on a waiter just waits
            return True

    def finish(self, result: Optional[CcResult], error: Optional[EmsException]) -> None:
        with self._lock:
            if self._cancelled and error is None:
                result, error = None, self.timeout_error()
            self._finish_locked(result, error)

    def _finish_locked(self, result: Optional[CcResult], error: Optional[EmsException]) -> None:
        if self._finished:
            return
        self._state = _State.DONE
        self._result, self._error = result, error
        self._finished = True
        if self._done is not None:
            self._done.set()

    def timeout_error(self) -> EmsException:
        """What the caller gets once the task was cancelled (its deadline passed)."""
        return EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                            f"{self.what} did not finish within timeout={self.timeout_ms} ms")

    # ----------------------------------------------------------- caller side
    def done(self) -> bool:
        return self._finished

    def wait(self) -> CcResult:
        if not self._finished:
            with self._lock:
                if self._done is None:
                    self._done = threading.Event()
                    if self._finished:
                        self._done.set()
            if not self._done.wait(self.remaining_s()):
                with self._lock:
                    if self._state is _State.QUEUED:
                        self._finish_locked(None, self.timeout_error())
                    elif self._state is _State.RUNNING:
                        self._cancelled = True
                # The worker stops at its next checkpoint (or is publishing already).
                self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class CcFuture:
    """Handle of an asynchronous request (``async_save`` / ``async_load``)."""

    def __init__(self, task: Task) -> None:
        self._task = task

    def result(self) -> CcResult:
        """Block until the request is done; raise :class:`EmsException` if it failed
        as a whole (timeout, pool lost, ...)."""
        return self._task.wait()

    def done(self) -> bool:
        """True once ``result()`` would not block (finished, or past its deadline)."""
        task = self._task
        if task.done():
            return True
        remaining = task.remaining_s()
        return remaining is not None and remaining <= 0.0

    def __repr__(self) -> str:
        state = "done" if self._task.done() else "pending"
        return f"<CcFuture {self._task.what} {state}>"

