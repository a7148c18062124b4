"""Helpers shared by the integration, fault, control and cluster tests."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ems.testing.leaks import check_server

KEY_A = "A" * 40
KEY_B = "B" * 40


def assert_idle(server, timeout_s: float = 5.0) -> dict:
    """Wait until ``server`` holds nothing a finished request took (pins, reservations,
    leases without their connection, write-behind): ``ems.testing.leaks.check_server``;
    the last report."""
    return check_server(server, timeout_s)


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


def record_sends(monkeypatch, session, into: Optional[list] = None) -> list:
    """Record the name of each request ``session`` sends (appended to ``into``, or to a
    new list), in order; the list."""
    from ems.protocol import messages as m

    sent: list[str] = [] if into is None else into
    send = session.send

    def recording(msg_for, wait_s):
        def build(rid):
            msg = msg_for(rid)
            sent.append(m.MESSAGES[msg[0] if type(msg) is list else msg.TYPE].__name__)
            return msg
        return send(build, wait_s)
    monkeypatch.setattr(session, "send", recording)
    return sent


def slow_copy(monkeypatch, nth: int, seconds: float) -> list[int]:
    """The client's ``nth`` bulk copy (``ems.client.copy.copy_bytes``) sleeps
    ``seconds`` first; a one-item list that counts the copies made so far."""
    from ems.client import copy as _copy

    copy = _copy.copy_bytes
    calls = [0]

    def slow(dst, src, n):
        calls[0] += 1
        if calls[0] == nth:
            time.sleep(seconds)
        return copy(dst, src, n)
    monkeypatch.setattr(_copy, "copy_bytes", slow)
    return calls
