"""Back-pressure from the disk's writer to the saves (issue #28, item 2), in process on
the fake clock: the pool evicts objects already written before those that are not
(``ems.pool.eviction``); a save that finds shared memory full of unwritten objects
waits for a write to end, up to ``save_wait_s``, and only then evicts one, counted as
``evicted_unwritten``."""

from __future__ import annotations

import collections
import socket
import threading
import time
from typing import ClassVar, Optional, Sequence

import pytest
from support.replies import Replies

from ems.pool import GrantStatus, Pool
from ems.protocol import messages as m
from ems.server.config import Limits
from ems.server.handlers import Handlers
from ems.server.session import Session
from ems.server.tenants import Tenant, TenantSpec
from ems.server.tier_driver import WRITTEN, DriverSettings, Engine, Sources, TierDriver, Written
from ems.testing.clock import FakeClock, FakeLoop

BLOCK = 4096


def test_written_objects_are_evicted_before_unwritten_ones():
    pool = Pool(4 * BLOCK, alignment=BLOCK)
    for key in "abcd":  # LRU order a, b, c, d
        pool.commit([pool.reserve([key], [BLOCK])[0].token])
    pool.mark_unwritten(["a", "b"])
    assert pool.unwritten("a") and not pool.unwritten("c")
    pool.commit([pool.reserve(["e"], [BLOCK])[0].token])
    pool.commit([pool.reserve(["f"], [BLOCK])[0].token])
    assert sorted(pool.keys()) == ["a", "b", "e", "f"]  # c, d went: written
    # nothing written is left but e and f; spared, the unwritten ones are not taken
    pool.mark_unwritten(["e", "f"])
    assert pool.reserve(["g"], [BLOCK], spare_unwritten=True)[0].status is GrantStatus.FULL
    assert pool.statistics().refused_full == 0  # (the daemon waits and asks again)
    assert pool.lease(BLOCK, "conn", spare_unwritten=True) is None
    # marks count: two writers of a, one done; a stays unwritten until the other is
    pool.mark_unwritten(["a"])
    pool.mark_written(["a", "b"])
    assert pool.unwritten("a") and not pool.unwritten("b")
    pool.commit([pool.reserve(["g"], [BLOCK], spare_unwritten=True)[0].token])
    assert "b" not in pool.keys()  # the one written
    pool.mark_unwritten(["g"])
    # not spared, the LRU unwritten object goes when nothing written is left
    pool.commit([pool.reserve(["h"], [BLOCK])[0].token])
    assert "a" not in pool.keys() and not pool.unwritten("a")  # (its marks forgotten)
    pool.mark_written(["a"])  # a writer done with an evicted key: nothing happens


class GatedEngine(Engine):
    """Writes block until the test opens the gate (a disk slower than the saves)."""

    name: ClassVar[str] = "gated"
    batch_writes: ClassVar[bool] = True

    def __init__(self) -> None:
        self.gate = threading.Semaphore(0)
        self.written: list[str] = []

    def lookup(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]]
               ) -> list[int]:
        return []  # (holds nothing the driver needs to skip)

    def write_batch(self, tenant: Tenant, sources: Sources,
                    deadline: Optional[float]) -> list[Written]:
        assert self.gate.acquire(timeout=10), "the test never opened the gate"
        self.written += sources.keys
        return [WRITTEN] * len(sources.keys)


@pytest.fixture
def world():
    clock = FakeClock()
    loop = FakeLoop(clock)
    tenant = Tenant(TenantSpec(None, None, 4 * BLOCK), 60.0, clock=clock)
    engine = GatedEngine()
    # one write in flight at a time (a quarter of the pool), the rest queued
    driver = TierDriver(engine, loop, DriverSettings(
        write_workers=1, inflight_bytes=BLOCK, tenant_share=0.25, queue_bytes=1 << 20,
        save_wait_s=0.1), lambda: [tenant], clock=clock)
    a, b = socket.socketpair()
    session = Session(1, a, 0, 0, clock())
    session.proto.phase = session.proto.phase.READY
    session.tenant = tenant
    out = Replies()
    handlers = Handlers(Limits(), [driver], out, collections.Counter(), clock=clock)
    handlers.opened(tenant)
    yield clock, loop, tenant, engine, driver, session, handlers, out
    for _ in range(16):
        engine.gate.release()
    driver.close()
    loop.advance(0)
    a.close()
    b.close()
    tenant.close()


def _save(handlers: Handlers, session: Session, pool: Pool, rid: int, keys: list[str]) -> None:
    handlers.serve(session, m.Reserve, [rid, keys, [BLOCK] * len(keys), True, None])


def _commit_reply(handlers: Handlers, session: Session, out: Replies) -> list[int]:
    """Commit every NEW grant of the last Granted reply; the statuses it had."""
    granted = out.wires[-1]
    statuses, tokens = granted[2], granted[3]
    new = [t for s, t in zip(statuses, tokens) if s == GrantStatus.NEW]
    handlers.serve(session, m.Commit, [granted[1] + 100, new, 0])
    return list(statuses)


def _full_of_unwritten(loop: FakeLoop, handlers: Handlers, session: Session, pool: Pool,
                       out: Replies) -> int:
    """Fill the pool (four blocks) with saves the gated writer has not written (the
    first is being written); the replies so far."""
    for i, key in enumerate("abcd"):
        _save(handlers, session, pool, i + 1, [key])
        _commit_reply(handlers, session, out)
    loop.advance(0)
    return len(out.wires)


def _settle(loop: FakeLoop, engine: GatedEngine, n: int, done) -> None:
    """Let ``n`` writes through and run the loop until ``done()``."""
    for _ in range(n):
        engine.gate.release()
    for _ in range(2000):
        loop.advance(0)
        if done():
            return
        time.sleep(0.001)
    raise AssertionError(f"not settled: {engine.written} written")


def test_a_save_waits_for_the_writer_instead_of_evicting_an_unwritten_object(world):
    clock, loop, tenant, engine, driver, session, handlers, out = world
    pool = tenant.pool
    for i, key in enumerate("abcd"):  # the pool full of objects not on disk yet
        _save(handlers, session, pool, i + 1, [key])
        assert _commit_reply(handlers, session, out) == [GrantStatus.NEW]
    loop.advance(0)
    assert sorted(pool.keys()) == list("abcd")
    replies = len(out.wires)
    _save(handlers, session, pool, 9, ["e"])
    assert len(out.wires) == replies  # waiting: no reply yet, nothing evicted
    assert sorted(pool.keys()) == list("abcd")
    _settle(loop, engine, 1, lambda: len(out.wires) > replies)  # a on disk: e takes its place
    assert out.wires[-1][0] == m.Granted.TYPE and out.wires[-1][1] == 9
    assert out.wires[-1][2] == [GrantStatus.NEW]
    assert "a" not in pool.keys() and driver.statistics().unwritten["evicted_unwritten"] == 0
    assert driver.statistics().save_waits == 1


def test_past_save_wait_s_a_save_evicts_an_unwritten_object_and_counts_it(world):
    clock, loop, tenant, engine, driver, session, handlers, out = world
    pool = tenant.pool
    replies = _full_of_unwritten(loop, handlers, session, pool, out)
    _save(handlers, session, pool, 9, ["e"])
    loop.advance(0.05)
    assert len(out.wires) == replies  # still within save_wait_s
    loop.advance(0.06)  # the writer is stuck: the save goes on, evicting one
    assert out.wires[-1][1] == 9 and out.wires[-1][2] == [GrantStatus.NEW]
    gone = set("abcd") - set(pool.keys())
    assert len(gone) == 1 and gone != {"a"}  # a is pinned (being written)
    _commit_reply(handlers, session, out)
    # a, then the queue; the evicted one is not found
    _settle(loop, engine, 3, lambda: len(engine.written) == 3 and driver.statistics()
            .unwritten["evicted_unwritten"] == 1)
    assert driver.statistics().unwritten["evicted_unwritten"] == 1
    assert sorted(engine.written) == sorted(set("abcd") - gone)


@pytest.mark.parametrize("budget_ms, waits_s", [(60, 0.03), (1000, 0.1), (0, 0.1)])
def test_a_save_waits_half_its_deadline_at_most(world, budget_ms, waits_s):
    """A Reserve's ``budget_ms`` (what is left of its deadline) bounds its wait to half
    of it, below ``save_wait_s`` (0.1 s here); 0 (no deadline): ``save_wait_s``."""
    clock, loop, tenant, engine, driver, session, handlers, out = world
    pool = tenant.pool
    replies = _full_of_unwritten(loop, handlers, session, pool, out)
    handlers.serve(session, m.Reserve, [9, ["e"], [BLOCK], True, None, True, budget_ms])
    loop.advance(waits_s - 0.005)
    assert len(out.wires) == replies  # still waiting
    assert driver.statistics().unwritten["evicted_unwritten"] == 0
    loop.advance(0.01)
    assert out.wires[-1][1] == 9 and out.wires[-1][2] == [GrantStatus.NEW]
    assert len(set("abcd") - set(pool.keys())) == 1  # one unwritten object evicted
    handlers.serve(session, m.Abort, [list(out.wires[-1][3])])
    _settle(loop, engine, 3, lambda: len(engine.written) == 3)
    assert driver.statistics().unwritten["evicted_unwritten"] == 1


def test_ems_stats_says_what_was_not_written_and_why():
    from ems.protocol.report import DaemonReport, DiskReport
    from ems.stats import format_report

    server = {"version": "t", "socket": "s", "pid": 1, "uptime_s": 1.0, "connections": 1,
              "capacity_bytes": 1 << 20, "tenants": 0, "anonymous": True}
    disk = DiskReport(path="/d", admission="all", save_waits=22,
                      unwritten={"queue_full": 0, "evicted_unwritten": 63, "caller": 4})
    report = DaemonReport.from_wire({"server": server, "tenants": {},
                                     "disk": disk.to_wire()})
    assert report.disk is not None and report.disk.unwritten["evicted_unwritten"] == 63
    line = next(x for x in format_report(report).splitlines() if "not written" in x)
    assert line.split(": ", 1)[1] == ("caller 4, evicted_unwritten 63; 22 save(s) waited "
                                      "for the writer")
    old = DiskReport(path="/d", admission="all", queue_dropped=3)  # an older daemon's
    text = format_report(DaemonReport.from_wire({"server": server, "tenants": {},
                                                 "disk": old.to_wire()}))
    assert "not admitted: queue_full 3" in text
