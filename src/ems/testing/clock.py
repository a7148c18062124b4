"""A clock the tests drive, and a loop whose ``call_at`` runs on it (trio's ``MockClock``).

Code that waits, expires or times out takes the clock it is given (``Pool``, ``Tenant``,
``Handlers``: ``clock=``; the tiers: a :class:`ems.server.tiers.Loop`). A test hands them
a :class:`FakeClock` and a :class:`FakeLoop` and moves time with :meth:`FakeLoop.advance`,
so a TTL or a deadline is crossed in microseconds instead of being waited out.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


class FakeClock:
    """Monotonic seconds that move only when told; call it like ``time.monotonic``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class FakeLoop:
    """A :class:`ems.server.tiers.Loop` on a :class:`FakeClock`: ``call_soon`` and
    ``call_at`` callbacks run, in time then arrival order, when the test advances."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.call_at(self.clock.now, fn)

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._due, (when, next(self._seq), fn))

    @property
    def pending(self) -> int:
        """Callbacks not yet run."""
        return len(self._due)

    def advance(self, seconds: float = 0.0) -> int:
        """Move the clock ``seconds`` on, running every callback due by then (each at
        its own time); returns how many ran."""
        until = self.clock.now + seconds
        ran = 0
        while self._due and self._due[0][0] <= until:
            when, _, fn = heapq.heappop(self._due)
            self.clock.now = max(self.clock.now, when)
            fn()
            ran += 1
        self.clock.now = until
        return ran
