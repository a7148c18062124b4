"""Helpers shared by the integration, fault, control and cluster tests."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

KEY_A = "A" * 40
KEY_B = "B" * 40


def assert_idle(server, timeout_s: float = 5.0) -> dict:
    """Wait until no tenant of ``server`` holds pins or reservations; the last report."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = server.stats()
        busy = {n: (t["pinned"], t["reserved"]) for n, t in report["tenants"].items()
                if t["pinned"] or t["reserved"]}
        if not busy:
            return report
        assert time.monotonic() < deadline, f"ems-server still holds (pins, reservations): {busy}"
        time.sleep(0.02)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str,
             interval_s: float = 0.05) -> Optional[Any]:
    """Poll ``predicate`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


def anonymous_stats(server) -> dict:
    """The statistics row of the anonymous namespace."""
    return server.stats()["tenants"]["(anonymous)"]


def anonymous_stats_when(server, predicate: Callable[[dict], bool], timeout_s: float,
                         what: str) -> dict:
    """Poll the anonymous namespace's statistics until ``predicate`` holds; return them."""
    def check() -> Optional[dict]:
        stats = anonymous_stats(server)
        return stats if predicate(stats) else None
    return wait_for(check, timeout_s, what)


def transport_save(transport, keys: list, size: int, timeout_ms: int = 5000) -> int:
    """Save ``pattern(key, size)`` of each storage key through a transport's verb; how
    many are stored."""
    import ctypes

    from ems import CcKvOption
    from ems.client.movers import V0Mover
    from ems.futures import Task
    from ems.keys import Request
    from support.client_worker import pattern

    bufs = [ctypes.create_string_buffer(pattern(k, size), size) for k in keys]
    mover = V0Mover([[(ctypes.addressof(b), size)] for b in bufs])
    req = Request("save", list(keys), [size] * len(keys), mover, CcKvOption(timeout=timeout_ms))
    return sum(transport.save(req, Task(timeout_ms, "save")))


def transport_load(transport, keys: list, size: int, timeout_ms: int = 5000):
    """Load storage keys through a transport's verb: (leading keys loaded, their bytes)."""
    import ctypes

    from ems import CcKvOption
    from ems.client.movers import V0Mover
    from ems.futures import Task
    from ems.keys import Request

    bufs = [ctypes.create_string_buffer(size) for _ in keys]
    mover = V0Mover([[(ctypes.addressof(b), size)] for b in bufs])
    req = Request("load", list(keys), [size] * len(keys), mover, CcKvOption(timeout=timeout_ms))
    n = transport.load(req, Task(timeout_ms, "load"))
    return n, [b.raw for b in bufs[:n]]
