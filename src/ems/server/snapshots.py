"""Snapshots of the daemon's report for threads beside its event loop."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from ems.protocol.report import DaemonReport

__all__ = ["LoopSnapshots"]


class LoopSnapshots:
    """The daemon's report, computed on its event loop for other threads (the
    Prometheus exporter, the control plane's reporter).

    The pools belong to the loop: another thread iterating their dictionaries could
    see them change under it. A reader asks (:meth:`get`), the loop builds a fresh
    report at its next wake-up (a few microseconds per tenant), and the reader gets
    that new, frozen :class:`~ems.protocol.report.DaemonReport`. A loop that does not
    answer within ``timeout_s`` (busy, or stopping) leaves the reader the previous
    snapshot.
    """

    def __init__(self, daemon: Any) -> None:
        self._daemon = daemon
        self._lock = threading.Lock()
        self._waiters: list[threading.Event] = []
        self._latest: Optional[DaemonReport] = None
        self.taken_at = 0.0
        daemon.wake_hooks.append(self._on_wake)

    def get(self, timeout_s: float = 1.0) -> Optional[DaemonReport]:
        event = threading.Event()
        with self._lock:
            self._waiters.append(event)
        self._daemon.wake()
        event.wait(timeout_s)
        with self._lock:
            if event in self._waiters:
                self._waiters.remove(event)
            return self._latest

    def _on_wake(self) -> None:  # on the loop
        with self._lock:
            if not self._waiters:
                return
            waiters, self._waiters = self._waiters, []
        report = self._daemon.statistics()
        with self._lock:
            self._latest = report
            self.taken_at = time.monotonic()
        for event in waiters:
            event.set()
