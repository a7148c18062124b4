"""The tier driver (``ems.server.tier_driver``) around an engine of this test's own that
keeps its values in a dict, on a real pool and the driver's real workers, with a loop
run by the test: a fill brings the leading run and counts it; two loads of the same
keys read them once; a read past its deadline is answered at the deadline and its
reservation given back when it returns, its bytes never committed; write-out waits
in the queue past the in-flight bound and is dropped past the queue, pins given back;
second-hit admission; a load waits for an engine not ready yet; the stop flush."""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, ClassVar, Optional, Sequence

import pytest
from support.itest_support import wait_for

from ems.server.memory import SegmentGone, SegmentMaps
from ems.server.tenants import Tenant, TenantSpec
from ems.server.tier_driver import (
    HELD,
    WRITTEN,
    DriverSettings,
    Engine,
    ReadOutcome,
    SecondHit,
    Sources,
    Target,
    TierDriver,
    Written,
)
from ems.testing.clock import FakeClock

SIZE = 1000


class HandLoop:
    """The daemon's loop as the driver sees it, run by the test (``run_until``), its
    timers on ``clock`` (the test moves it: ``ems.testing.clock.FakeClock``)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._soon: collections.deque[Callable[[], None]] = collections.deque()
        self._at: list[tuple[float, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._soon.append(fn)

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        with self._lock:
            self._at.append((when, fn))

    def drain(self) -> None:
        """Run what is queued on the loop now."""
        while self._soon:
            self._soon.popleft()()

    def run_until(self, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
        end = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < end, "the driver never got there"
            self.drain()
            now = self.clock()
            with self._lock:
                due = [fn for when, fn in self._at if when <= now]
                self._at = [(w, fn) for w, fn in self._at if w > now]
            for fn in due:
                fn()
            time.sleep(0.001)


class DictEngine(Engine):
    name: ClassVar[str] = "dict"
    local: ClassVar[bool] = True

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.reads: list[str] = []
        self.read_gate = threading.Event()
        self.write_gate = threading.Event()
        self.read_gate.set()
        self.write_gate.set()
        self.is_ready = threading.Event()
        self.is_ready.set()

    def ready(self) -> bool:
        return self.is_ready.is_set()

    def wait_ready(self, timeout_s: float) -> None:
        self.is_ready.wait(timeout_s)

    def lookup(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]]
               ) -> list[int]:
        run = []
        for i, key in enumerate(keys):
            value = self.values.get(key)
            if value is None or (sizes is not None and sizes[i] != len(value)):
                break
            run.append(len(value))
        return run

    def read(self, tenant: Tenant, target: Target, deadline: float) -> ReadOutcome:
        self.reads.append(target.key)
        assert self.read_gate.wait(10)
        target.memory[:] = self.values[target.key]
        return ReadOutcome.HIT

    def write(self, tenant: Tenant, source: Target, deadline: Optional[float]) -> Written:
        assert self.write_gate.wait(10)
        if len(self.values.get(source.key, b"")) == source.memory.nbytes:
            return HELD
        self.values[source.key] = bytes(source.memory)
        return WRITTEN


def _value(key: str) -> bytes:
    return (key.encode() * SIZE)[:SIZE]


@pytest.fixture
def world():
    tenant = Tenant(TenantSpec(None, None, 1 << 20), 60.0)
    maps = SegmentMaps()
    made: list[TierDriver] = []
    clock = FakeClock()
    loop = HandLoop(clock)

    def make(engine: Engine, **settings) -> TierDriver:
        settings.setdefault("read_workers", 2)
        settings.setdefault("write_workers", 2)
        driver = TierDriver(engine, loop, DriverSettings(**settings), lambda: [tenant],
                            clock=clock)
        made.append(driver)
        return driver
    yield tenant, maps, loop, make
    for driver in made:
        driver.close()
    loop.drain()
    maps.close()
    assert tenant.pool.statistics().pinned == 0 and tenant.pool.statistics().reserved == 0
    tenant.close()


def _save(tenant: Tenant, maps: SegmentMaps, key: str) -> None:
    """A client's save: reserve, write the bytes, commit."""
    grant = tenant.pool.reserve([key], [SIZE], "client")[0]
    view = maps.view(tenant, grant.offset, grant.size)
    view[:] = _value(key)
    view.release()
    assert tenant.pool.commit([grant.token], "client") == [True]


def _pinned_bytes(tenant: Tenant, maps: SegmentMaps, keys: list[str]) -> list[bytes]:
    pins = tenant.pool.acquire(keys, None, "reader")
    out = []
    for pin in pins:
        view = maps.view(tenant, pin.offset, pin.size)
        out.append(bytes(view))
        view.release()
    tenant.pool.release([p.token for p in pins], "reader")
    return out


def test_a_fill_brings_the_leading_run_and_counts_it(world):
    tenant, maps, loop, make = world
    engine = DictEngine()
    engine.values = {k: _value(k) for k in ("a", "b", "d")}
    driver = make(engine)
    done: list[bool] = []
    assert driver.fill(tenant, ["a", "b", "c", "d"], None, None, lambda: done.append(True))
    loop.run_until(lambda: bool(done))
    assert _pinned_bytes(tenant, maps, ["a", "b", "c"]) == [_value("a"), _value("b")]
    st = driver.statistics()
    assert (st.lookups, st.hits, st.misses, st.bytes_in) == (2, 2, 0, 2 * SIZE)
    assert driver.statistics(tenant).hits == 2
    assert not driver.fill(tenant, ["c"], None, None, lambda: None)  # held nowhere
    assert driver.statistics().misses == 1


def test_two_loads_of_the_same_keys_read_them_once(world):
    tenant, maps, loop, make = world
    engine = DictEngine()
    engine.values = {k: _value(k) for k in ("a", "b")}
    engine.read_gate.clear()
    driver = make(engine)
    done: list[int] = []
    assert driver.fill(tenant, ["a", "b"], None, None, lambda: done.append(1))
    assert driver.fill(tenant, ["a", "b"], None, None, lambda: done.append(2))
    engine.read_gate.set()
    loop.run_until(lambda: len(done) == 2)
    assert sorted(engine.reads) == ["a", "b"]
    assert _pinned_bytes(tenant, maps, ["a", "b"]) == [_value("a"), _value("b")]


def test_a_read_past_its_deadline_is_answered_then_given_back(world):
    tenant, maps, loop, make = world
    engine = DictEngine()
    engine.values = {"a": _value("a")}
    engine.read_gate.clear()
    driver = make(engine)
    done: list[bool] = []
    clock = loop.clock
    assert driver.fill(tenant, ["a"], None, clock() + 0.05, lambda: done.append(True))
    loop.run_until(lambda: engine.reads == ["a"])  # the read has begun (and is stuck)
    loop.drain()
    assert not done  # before the deadline: no answer
    clock.now += 0.05
    loop.run_until(lambda: bool(done))  # at the deadline, the read still running
    assert tenant.pool.exists(["a"]) == 0 and tenant.pool.statistics().reserved == 1
    assert driver.statistics().read_timeouts == 1
    engine.read_gate.set()
    loop.run_until(lambda: tenant.pool.statistics().reserved == 0)
    assert tenant.pool.exists(["a"]) == 0  # its bytes never shown


def test_write_out_waits_past_the_bound_and_is_dropped_past_the_queue(world):
    tenant, maps, loop, make = world
    engine = DictEngine()
    engine.write_gate.clear()
    driver = make(engine, inflight_bytes=SIZE + SIZE // 2, queue_bytes=SIZE)
    for key in ("a", "b", "c"):
        _save(tenant, maps, key)
    driver.stored(tenant, ["a", "b", "c"], [SIZE] * 3)
    st = driver.statistics()
    assert (st.inflight_bytes, st.queued_bytes, st.dropped) == (SIZE, SIZE, 1)
    assert tenant.pool.statistics().pinned == 1  # only what is being written
    engine.write_gate.set()
    loop.run_until(lambda: driver.statistics().writes == 2)
    loop.run_until(lambda: tenant.pool.statistics().pinned == 0)
    assert engine.values == {"a": _value("a"), "b": _value("b")}
    driver.stored(tenant, ["a"], [SIZE])  # held already: the engine says so, no write
    loop.run_until(lambda: driver.statistics().inflight_bytes == 0)
    st = driver.statistics()
    assert (st.writes, st.refused) == (2, {}) and tenant.pool.statistics().pinned == 0


def _mapped(tenant: Tenant) -> int:
    """Mappings of ``tenant``'s memfd in this process."""
    name = f"/memfd:ems-pool-{tenant.name} "
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def _rss(tenant: Tenant) -> int:
    """Bytes of ``tenant``'s memory in this process's page tables (its mappings' Rss)."""
    name = f"/memfd:ems-pool-{tenant.name} "
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line
                inside = name in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_a_mapping_is_populated_in_the_background():
    tenant = Tenant(TenantSpec("fill", "k", 8 << 20), 60.0)
    maps = SegmentMaps()
    try:
        maps.prepare(tenant)
        wait_for(lambda: maps.populated_bytes == tenant.segment_size, 10.0, "populated")
        assert _mapped(tenant) == 1 and _rss(tenant) == tenant.segment_size
        out = maps.view(tenant, 4096, 8)  # the same mapping
        out.release()
        assert _mapped(tenant) == 1
    finally:
        maps.close()
        tenant.close()


def test_a_deleted_tenant_s_memory_is_unmapped_with_its_last_view():
    tenant = Tenant(TenantSpec("gone", "k", 1 << 20), 60.0)
    maps = SegmentMaps()
    try:
        out = maps.view(tenant, 0, 64)  # a write or read in flight
        assert _mapped(tenant) == 1
        maps.forget(tenant)
        out[:3] = b"abc"  # still valid until released
        assert _mapped(tenant) == 1
        out.release()  # (and the populating thread's chunk, if it was in one)
        wait_for(lambda: _mapped(tenant) == 0, 10.0, "the mapping gone")
        with pytest.raises(SegmentGone):  # never mapped again (its fd closes next)
            maps.view(tenant, 0, 64)
        maps.forget(tenant)  # twice: nothing more to do
    finally:
        maps.close()
        tenant.close()


def test_a_deleted_tenant_s_write_outs_end_and_its_queue_goes(world):
    tenant, maps, loop, make = world

    class Entered(DictEngine):
        def __init__(self) -> None:
            super().__init__()
            self.entered = threading.Event()

        def write(self, tenant: Tenant, source: Target, deadline: Optional[float]) -> Written:
            self.entered.set()
            return super().write(tenant, source, deadline)
    engine = Entered()
    engine.write_gate.clear()
    driver = make(engine, inflight_bytes=SIZE, queue_bytes=4 * SIZE)
    for key in ("a", "b", "c"):
        _save(tenant, maps, key)
    driver.stored(tenant, ["a", "b", "c"], [SIZE] * 3)
    assert engine.entered.wait(10)  # "a" is being written, from its view
    st = driver.statistics()
    assert (st.inflight_bytes, st.queued_bytes) == (SIZE, 2 * SIZE)
    driver.removed(tenant)
    assert driver.statistics().queued_bytes == 0
    engine.write_gate.set()  # the write in flight ends as usual, from intact memory
    loop.run_until(lambda: driver.statistics().inflight_bytes == 0)
    assert engine.values == {"a": _value("a")}
    assert tenant.pool.statistics().pinned == 0
    engine.values["z"] = _value("z")
    done: list[bool] = []  # a fill that comes after: nowhere to read into, a miss
    assert driver.fill(tenant, ["z"], None, None, lambda: done.append(True))
    loop.run_until(lambda: bool(done))
    assert (driver.statistics().hits, driver.statistics().misses) == (0, 1)
    assert "z" not in tenant.pool.keys() and tenant.pool.statistics().reserved == 0


def test_second_hit_admits_a_key_saved_again(world):
    tenant, maps, loop, make = world
    engine = DictEngine()
    engine.admission = SecondHit()
    driver = make(engine)
    _save(tenant, maps, "a")
    driver.stored(tenant, ["a"], [SIZE])
    assert driver.statistics().not_admitted == 1 and engine.values == {}
    driver.stored(tenant, ["a"], [SIZE])
    loop.run_until(lambda: driver.statistics().writes == 1)
    assert engine.values == {"a": _value("a")}


def test_a_load_waits_for_an_engine_not_ready(world):
    tenant, maps, loop, make = world
    engine = DictEngine()
    engine.values = {"a": _value("a")}
    engine.is_ready.clear()
    driver = make(engine)
    done: list[bool] = []
    counted: list[int] = []
    assert driver.fill(tenant, ["a"], None, None, lambda: done.append(True))
    assert driver.count(tenant, ["a", "b"], None, None, counted.append)
    engine.is_ready.set()
    loop.run_until(lambda: bool(done) and bool(counted))
    assert counted == [1] and tenant.pool.exists(["a"]) == 1


def test_the_stop_flush_writes_what_the_engine_lacks(world):
    tenant, maps, loop, make = world
    engine = DictEngine()
    engine.values = {"a": _value("a")}
    driver = make(engine, flush_on_stop_s=5.0)
    for key in ("a", "b"):
        _save(tenant, maps, key)
    driver.close()
    loop.drain()
    assert engine.values == {"a": _value("a"), "b": _value("b")}
    assert driver.statistics().flushed_on_stop == 1


def test_write_out_false_is_counted_and_passed_over_by_the_stop_flush(world):
    """The caller's ``write_out`` False: not written out, not remembered by SecondHit,
    counted; the stop's flush passes it over (within ``skipped_remember``: past it the
    oldest is forgotten, counted, and flushed); saved again with it True, written."""
    tenant, maps, loop, make = world
    engine = DictEngine()
    engine.admission = SecondHit()
    driver = make(engine, flush_on_stop_s=5.0, skipped_remember=2)
    for key in ("a", "b", "c", "d"):
        _save(tenant, maps, key)
    driver.stored(tenant, ["a", "b", "c"], [SIZE] * 3, write_out=False)
    stats = driver.statistics()
    assert (stats.skipped_caller, stats.skipped_forgotten, stats.not_admitted) == (3, 1, 0)
    driver.stored(tenant, ["c"], [SIZE])  # SecondHit's first sight of c: not admitted
    assert driver.statistics().not_admitted == 1 and engine.values == {}
    driver.close()
    loop.drain()
    # a (forgotten past the bound) and c (saved again with write_out) and d are written
    assert sorted(engine.values) == ["a", "c", "d"]
    assert driver.statistics().flushed_on_stop == 3


def test_a_value_larger_than_the_bound_goes_alone_only_with_a_queue(world):
    tenant, maps, loop, make = world
    queued, queueless = DictEngine(), DictEngine()
    with_queue = make(queued, inflight_bytes=SIZE // 2, queue_bytes=SIZE)
    without = make(queueless, inflight_bytes=SIZE // 2, queue_bytes=0)  # the cluster's
    _save(tenant, maps, "a")
    with_queue.stored(tenant, ["a"], [SIZE])  # nothing in flight: it goes alone
    without.stored(tenant, ["a"], [SIZE])  # nowhere to wait: dropped
    loop.run_until(lambda: with_queue.statistics().writes == 1)
    assert queued.values == {"a": _value("a")} and queueless.values == {}
    assert without.statistics().dropped == 1


class ChunkEngine(DictEngine):
    """Writes in batches, a chunk at most ``write_chunk_bytes``; records each batch and
    how many ran at once."""

    batch_writes: ClassVar[bool] = True

    def __init__(self, chunk: int) -> None:
        super().__init__()
        self.write_chunk_bytes = chunk
        self.batches: list[list[str]] = []
        self.running = self.most = 0
        self._lock = threading.Lock()

    def write_batch(self, tenant: Tenant, sources: Sources,
                    deadline: Optional[float]) -> list[Written]:
        with self._lock:
            self.batches.append(list(sources.keys))
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            assert self.write_gate.wait(10)
            return [self.write(tenant, t, deadline) for t in sources.targets()]
        finally:
            with self._lock:
                self.running -= 1


def test_a_save_larger_than_the_write_chunk_is_written_in_chunks_side_by_side(world):
    tenant, maps, loop, make = world
    engine = ChunkEngine(chunk=2 * SIZE)
    engine.write_gate.clear()
    driver = make(engine, write_workers=3)
    keys = [f"k{i}" for i in range(5)]
    for key in keys:
        _save(tenant, maps, key)
    driver.stored(tenant, keys, [SIZE] * 5)  # one save: one write-out of 5 values
    loop.run_until(lambda: engine.running == 3)  # its three chunks at once
    # three worker threads: the chunks are the same, their order is not fixed
    assert sorted(engine.batches) == [["k0", "k1"], ["k2", "k3"], ["k4"]]
    assert driver.statistics().inflight_bytes == 5 * SIZE
    engine.write_gate.set()
    loop.run_until(lambda: driver.statistics().writes == 5)
    loop.run_until(lambda: driver.statistics().inflight_bytes == 0)
    assert engine.values == {k: _value(k) for k in keys} and engine.most == 3


class ShareEngine(DictEngine):
    """Records each batch of reads and the threads they ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[str]] = []
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def read_batch(self, tenant: Tenant, targets: Sequence[Target], deadline: float
                   ) -> list[ReadOutcome]:
        with self._lock:
            self.seen.append([t.key for t in targets])
            self.threads.add(threading.get_ident())
        return super().read_batch(tenant, targets, deadline)


def test_a_fetch_is_read_in_one_contiguous_share_per_reader(world):
    tenant, maps, loop, make = world
    engine = ShareEngine()
    keys = [f"r{i}" for i in range(10)]
    engine.values = {k: _value(k) for k in keys}
    engine.read_gate.clear()
    driver = make(engine, read_workers=3)
    done: list[bool] = []
    assert driver.fill(tenant, keys, [SIZE] * 10, None, lambda: done.append(True))
    loop.run_until(lambda: len(engine.seen) == 3)  # three jobs, each at its first read
    engine.read_gate.set()
    loop.run_until(lambda: bool(done))
    assert sorted(engine.seen) == sorted([keys[0:3], keys[3:6], keys[6:10]])
    assert len(engine.threads) == 3
    assert _pinned_bytes(tenant, maps, keys) == [_value(k) for k in keys]


def test_a_share_carries_the_engine_s_read_share_bytes(world):
    """An engine whose reads want ``read_share_bytes`` each: a fetch of 10 values of
    SIZE with 8 readers goes in as many shares as it has whole share sizes (here 3,
    the last one the longer), never in shares smaller; one of a single share size, or
    less, in one share."""
    tenant, maps, loop, make = world
    engine = ShareEngine()
    engine.read_share_bytes = 3 * SIZE
    keys = [f"s{i}" for i in range(10)]
    engine.values = {k: _value(k) for k in keys}
    driver = make(engine, read_workers=8)
    done: list[bool] = []
    assert driver.fill(tenant, keys, [SIZE] * 10, None, lambda: done.append(True))
    loop.run_until(lambda: bool(done))
    assert sorted(engine.seen) == sorted([keys[0:3], keys[3:6], keys[6:10]])
    assert _pinned_bytes(tenant, maps, keys) == [_value(k) for k in keys]
    engine.seen.clear()
    small = [f"t{i}" for i in range(2)]
    engine.values.update({k: _value(k) for k in small})
    done.clear()
    assert driver.fill(tenant, small, [SIZE] * 2, None, lambda: done.append(True))
    loop.run_until(lambda: bool(done))
    assert engine.seen == [small]
