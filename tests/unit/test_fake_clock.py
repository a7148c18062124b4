"""The fake clock and loop (``ems.testing.clock``), and the handlers and a tenant's pool
on it: a reservation's TTL and a request's tier deadline follow the injected clock."""

from __future__ import annotations

import collections
import socket

from support.replies import Replies

from ems.protocol import messages as m
from ems.server.config import Limits
from ems.server.handlers import BUDGET_SHARE, Handlers
from ems.server.session import Session
from ems.server.tenants import Tenant, TenantSpec
from ems.testing.clock import FakeClock, FakeLoop


def test_the_fake_loop_runs_callbacks_in_time_order_at_their_time():
    clock = FakeClock()
    loop = FakeLoop(clock)
    seen: list[tuple[str, float]] = []
    loop.call_at(clock.now + 2, lambda: seen.append(("b", clock())))
    loop.call_at(clock.now + 1, lambda: seen.append(("a", clock())))
    loop.call_soon(lambda: seen.append(("now", clock())))
    assert loop.advance(0) == 1 and seen == [("now", 1000.0)]
    assert loop.advance(1.5) == 1 and seen[-1] == ("a", 1001.0) and clock() == 1001.5
    assert loop.advance(10) == 1 and seen[-1] == ("b", 1002.0) and loop.pending == 0


def test_a_reservation_expires_on_the_tenants_clock_not_in_real_time():
    clock = FakeClock()
    tenant = Tenant(TenantSpec(None, None, 1 << 20), 60.0, clock=clock)
    a, b = socket.socketpair()
    try:
        session = Session(1, a, 0, 0, clock())
        session.proto.phase = session.proto.phase.READY
        session.tenant = tenant
        out = Replies()
        h = Handlers(Limits(), [], out, collections.Counter(), clock=clock)
        h.serve(session, m.Reserve, [1, ["k"], [1000], False, None])
        assert tenant.pool.statistics().reserved_bytes > 0
        clock.now += 59.9
        assert tenant.pool.expire() == 0
        clock.now += 0.2
        assert tenant.pool.expire() == 1
        assert tenant.pool.statistics().reserved_bytes == 0
        # a tier's deadline is the handlers' clock plus the request's share of budget
        assert h._deadline(1000) == clock() + BUDGET_SHARE
    finally:
        a.close()
        b.close()
        tenant.close()
