"""Time-bound behaviours of the daemon in process, on the fake clock
(``ems.testing.clock``): a stuck writer's reservation expires at the TTL and its late
commit stores nothing; a tier fill past its deadline is answered at the deadline and
the late read's bytes are never shown; the per-request limits refuse a request and
keep the session; the daemon's handshake timeout and TTL expiry follow its clock.

Each has one end-to-end test in ``tests/faults`` (a real daemon, real time):
``test_recovery.py::test_a_stuck_writer_loses_its_reservation_after_the_ttl``,
``test_disk_tier.py::test_a_slow_disk_keeps_the_deadline_and_no_byte_arrives_late``,
``test_holes.py::test_a_huge_batch_and_huge_keys_are_refused_without_stalling_others``,
``test_hostile.py::test_slow_loris_clients_do_not_slow_the_others``."""

from __future__ import annotations

import collections
import socket
import threading
import time
from typing import ClassVar, Optional, Sequence, TypeVar

import pytest
from support.replies import Replies

from ems.errors import EmsErrorCode
from ems.pool import GrantStatus
from ems.protocol import FrameDecoder, encode
from ems.protocol import messages as m
from ems.server.config import Limits, ServerConfig
from ems.server.daemon import Daemon
from ems.server.handlers import BUDGET_SHARE, Handlers
from ems.server.memory import SegmentMaps
from ems.server.session import Session
from ems.server.tenants import Tenant, TenantRegistry, TenantSpec
from ems.server.tier_driver import DriverSettings, Engine, ReadOutcome, Target, TierDriver
from ems.testing.clock import FakeClock, FakeLoop

SIZE = 4096
TTL_S = 60.0


class GatedReads(Engine):
    """Holds ``values``; each read blocks until the test opens the gate (a slow disk)."""

    name: ClassVar[str] = "gated"
    local: ClassVar[bool] = True

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values
        self.gate = threading.Semaphore(0)
        self.reads = 0

    def lookup(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]]
               ) -> list[int]:
        run = []
        for key in keys:
            if key not in self.values:
                break
            run.append(len(self.values[key]))
        return run

    def read(self, tenant: Tenant, target: Target, deadline: float) -> ReadOutcome:
        assert self.gate.acquire(timeout=10), "the test never opened the gate"
        self.reads += 1
        target.memory[:] = self.values[target.key]
        return ReadOutcome.HIT


@pytest.fixture
def world():
    clock = FakeClock()
    loop = FakeLoop(clock)
    tenant = Tenant(TenantSpec(None, None, 1 << 20), TTL_S, clock=clock)
    a, b = socket.socketpair()
    session = Session(1, a, 0, 0, clock())
    session.proto.phase = session.proto.phase.READY  # past the handshake
    session.tenant = tenant
    yield clock, loop, tenant, session
    a.close()
    b.close()
    tenant.close()


_M = TypeVar("_M", bound=m.Message)


def _msg(cls: type[_M], wire: list[object]) -> _M:
    """A reply the handlers sent, as its message (of class ``cls``)."""
    msg = m.from_wire(wire)
    assert isinstance(msg, cls), msg
    return msg


def _value(key: str) -> bytes:
    return (key.encode() * SIZE)[:SIZE]


def _settle(loop: FakeLoop, done, timeout_s: float = 5.0) -> None:
    """Run the loop (not advancing the clock) until ``done()``: the driver's workers
    hand their completions to it from real threads."""
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, "the driver never got there"
        loop.advance(0)
        time.sleep(0.001)


def test_a_stuck_writers_reservation_expires_at_the_ttl_and_its_commit_stores_nothing(
        world):
    clock, loop, tenant, session = world
    out = Replies()
    handlers = Handlers(Limits(), [], out, collections.Counter(), clock=clock)
    handlers.serve(session, m.Reserve, [1, ["k"], [SIZE], True, None])
    granted = _msg(m.Granted, out.wires[-1])
    assert granted.statuses == [GrantStatus.NEW]
    clock.now += TTL_S - 0.001  # the writer is stuck: nothing happens before the TTL
    assert tenant.pool.expire() == 0 and tenant.pool.statistics().reserved == 1
    clock.now += 0.002
    assert tenant.pool.expire() == 1
    stats = tenant.pool.statistics()
    assert (stats.reserved, stats.used_bytes, stats.expired_reservations) == (0, 0, 1)
    handlers.serve(session, m.Commit, [2, granted.tokens, 0])  # it wakes up, too late
    assert _msg(m.Committed, out.wires[-1]).ok == [False]
    assert tenant.pool.exists(["k"]) == 0
    handlers.serve(session, m.Reserve, [3, ["k"], [SIZE], True, None])  # the space is back
    assert _msg(m.Granted, out.wires[-1]).statuses == [GrantStatus.NEW]


def test_a_tier_fill_past_its_deadline_is_answered_then_and_its_bytes_never_shown(world):
    clock, loop, tenant, session = world
    maps = SegmentMaps()
    engine = GatedReads({"b": _value("b")})
    driver = TierDriver(engine, loop, DriverSettings(read_workers=2), lambda: [tenant],
                        clock=clock)
    out = Replies()
    handlers = Handlers(Limits(), [driver], out, collections.Counter(), clock=clock)
    handlers.opened(tenant)
    try:
        grant = tenant.pool.reserve(["a"], [SIZE], "client")[0]  # a in shared memory
        tenant.pool.commit([grant.token], "client")
        budget_ms = 1000
        deadline_s = budget_ms / 1000 * BUDGET_SHARE
        handlers.serve(session, m.Acquire, [1, ["a", "b"], [SIZE, SIZE], False, budget_ms])
        loop.advance(deadline_s - 0.001)  # b's read is stuck on the slow disk
        assert out.wires == [] and tenant.pool.statistics().reserved == 1
        loop.advance(0.001)  # the deadline: answered with what shared memory had
        pinned = _msg(m.Pinned, out.wires[-1])
        assert (pinned.rid, pinned.sizes) == (1, [SIZE])  # a only
        handlers.serve(session, m.Release, [pinned.tokens])
        assert driver.statistics().read_timeouts == 1
        assert tenant.pool.exists(["b"]) == 0  # b's space stays reserved, never shown
        engine.gate.release()  # the late read returns: its reservation is given back
        _settle(loop, lambda: tenant.pool.statistics().reserved == 0)
        assert tenant.pool.exists(["b"]) == 0 and engine.reads == 1
        assert driver.statistics().hits == 0
        # a load after it reads b again, in time this once
        engine.gate.release()
        handlers.serve(session, m.Acquire, [2, ["b"], [SIZE], False, budget_ms])
        _settle(loop, lambda: len(out.wires) == 2)
        again = _msg(m.Pinned, out.wires[-1])
        assert again.sizes == [SIZE] and driver.statistics().hits == 1
        view = maps.view(tenant, again.offsets[0], SIZE)
        assert bytes(view) == _value("b")
        view.release()
        handlers.serve(session, m.Release, [again.tokens])
    finally:
        for _ in range(4):
            engine.gate.release()
        driver.close()
        loop.advance(0)
        maps.close()
    stats = tenant.pool.statistics()
    assert (stats.pinned, stats.reserved) == (0, 0)


def test_the_per_request_limits_refuse_a_request_and_keep_the_session(world):
    clock, loop, tenant, session = world
    out = Replies()
    refused: collections.Counter = collections.Counter()
    limits = Limits(max_keys_per_request=4, max_pins_per_connection=2)
    handlers = Handlers(limits, [], out, refused, clock=clock)
    handlers.serve(session, m.Reserve, [1, list("abcde"), [SIZE] * 5, True, None])
    error = _msg(m.Error, out.wires[-1])
    assert (error.rid, error.code) == (1, EmsErrorCode.EMS_INVALID_ARGUMENT.value)
    assert "max_keys_per_request" in error.message
    handlers.serve(session, m.Reserve, [2, ["k" * (limits.max_key_bytes + 1)], [SIZE], True, None])
    error = _msg(m.Error, out.wires[-1])
    assert error.rid == 2 and "max_key_bytes" in error.message
    assert tenant.pool.statistics().reserved == 0  # nothing done for either
    # within the limits the session goes on; pins past its limit miss
    handlers.serve(session, m.Reserve, [3, list("abc"), [SIZE] * 3, True, None])
    handlers.serve(session, m.Commit, [4, _msg(m.Granted, out.wires[-1]).tokens, 0])
    handlers.serve(session, m.Acquire, [5, list("abc"), None, False, 0])
    pinned = _msg(m.Pinned, out.wires[-1])
    assert len(pinned.tokens) == 2 and session.pins == 2
    handlers.serve(session, m.Release, [pinned.tokens])
    assert refused == {"max_keys_per_request": 1, "max_key_bytes": 1,
                       "max_pins_per_connection": 1}


# ---------------------------------------------------------------- the daemon's clock

def _turn(daemon: Daemon) -> None:
    """What one pass of the daemon's loop does with the events ready now (the loop of
    ``serve_forever`` without its signals and real-time waits)."""
    for fd, mask in daemon._epoll.poll(0.05):
        data = daemon._by_fd.get(fd)
        if data is not None:
            daemon._dispatch(data, mask)


def _frames(sock: socket.socket, decoder: FrameDecoder) -> list[m.Message]:
    """The frames the daemon has sent (it sends on the loop, before ``_turn`` or
    ``_tick`` returns: nothing to wait for); [None]: it closed the connection."""
    try:
        data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return []
    if not data:
        return [None]  # type: ignore[list-item]
    decoder.feed(data)
    return list(decoder)


def test_the_daemon_times_out_handshakes_and_expires_reservations_on_its_clock(tmp_path):
    clock = FakeClock()
    registry = TenantRegistry([TenantSpec(None, None, 1 << 20)], TTL_S, clock=clock)
    config = ServerConfig(socket_dir=str(tmp_path / "s"), capacity_bytes=1 << 20,
                          reservation_ttl_s=TTL_S)
    daemon = Daemon(config, registry)
    assert daemon.clock is clock and daemon.handlers._clock is clock
    daemon.start()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    writer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        silent.connect(daemon.path)  # never says hello
        writer.connect(daemon.path)
        writer.sendall(encode(m.Hello(None, False)))
        decoder = FrameDecoder()
        welcome: list[m.Message] = []
        for _ in range(20):
            _turn(daemon)
            welcome += _frames(writer, decoder)
            if welcome:
                break
        assert isinstance(welcome[0], m.Welcome)
        writer.sendall(encode(m.Reserve(1, ["k"], [SIZE])))
        _turn(daemon)
        assert isinstance(_frames(writer, decoder)[0], m.Granted)
        pool = registry.anonymous.pool
        assert pool.statistics().reserved == 1
        limit_s = daemon.limits.handshake_timeout_s
        clock.now += limit_s - 0.001  # real time does not count: nothing is late yet
        daemon._tick()
        assert not any(_frames(silent, FrameDecoder()))
        clock.now += 0.002
        daemon._tick()
        frames = _frames(silent, FrameDecoder())
        assert isinstance(frames[0], m.Error)
        assert frames[0].code == EmsErrorCode.EMS_IO_TIMEOUT.value
        assert pool.statistics().reserved == 1  # the TTL is longer
        clock.now += TTL_S
        daemon._tick()  # the writer is stuck: its reservation expires
        assert (pool.statistics().reserved, pool.statistics().expired_reservations) == (0, 1)
        writer.sendall(encode(m.Ping(7)))  # and its session lives on
        _turn(daemon)
        assert isinstance(_frames(writer, decoder)[0], m.Pong)
    finally:
        silent.close()
        writer.close()
        daemon.close()
