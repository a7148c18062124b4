"""Thread-safe counters behind an integration's frozen statistics dataclass.

``Counters(SomeStatistics)`` keeps one running total per field of ``SomeStatistics``
(ints and seconds) and what changed since the engine last asked (``interval()``: vLLM's
per-step stats, SGLang's metrics). Engine threads add to it from hooks and I/O threads
at once, so every change takes the lock (a few hundred ns; hooks run per step, not
per token).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Generic, TypeVar

__all__ = ["Counters"]

T = TypeVar("T")


class Counters(Generic[T]):
    """Totals and the current interval of every field of the dataclass ``kind``."""

    def __init__(self, kind: type[T]) -> None:
        self._kind = kind
        self.names = tuple(f.name for f in dataclasses.fields(kind))  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self._total: dict[str, float] = dict.fromkeys(self.names, 0)
        self._interval: dict[str, float] = dict.fromkeys(self.names, 0)

    def add(self, **changes: float) -> None:
        with self._lock:
            for k, v in changes.items():
                self._total[k] += v
                self._interval[k] += v

    def interval(self) -> dict[str, float]:
        """What changed since the last call (non-zero fields only)."""
        with self._lock:
            out, self._interval = self._interval, dict.fromkeys(self.names, 0)
        return {k: v for k, v in out.items() if v}

    def snapshot(self) -> T:
        with self._lock:
            return self._kind(**self._total)
