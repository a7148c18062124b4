"""How the pool hands out space (issue 26): an allocation of N bytes evicts at most N
bytes plus one object (plus what a lowered limit is exceeded by), a lease at most its
LRU victim, a full pool holds live objects in (nearly) all of its bytes, the accounting
adds up, and the pool is never below exact LRU on a prefix-caching trace."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.kv_trace import lru_hit_rate, replay_pool, synthetic_trace

from ems.pool import GrantStatus, Pool

KIB = 1 << 10
MIB = 1 << 20


def put(pool: Pool, key, size: int) -> GrantStatus:
    (g,) = pool.reserve([key], [size], "w")
    if g.status is GrantStatus.NEW:
        assert pool.commit([g.token], "w") == [True]
    return g.status


def shuffled_full_pool(capacity: int, size: int, seed: int = 0) -> Pool:
    """A pool full of ``size`` objects 0, 1, ... whose LRU order is not their address
    order: ``touch_order(capacity // size, seed)``."""
    pool = Pool(capacity)
    n = capacity // size
    for i in range(n):
        assert put(pool, i, size) is GrantStatus.NEW
    for i in touch_order(n, seed):  # touch every object in a random order
        pool.release([p.token for p in pool.acquire([i], owner="r")], owner="r")
    return pool


def touch_order(n: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(n), n)


# ----------------------------------------------------------------- the case

def test_a_lease_on_a_full_pool_of_small_objects_evicts_nothing():
    # Before: one 1 MiB lease on a full pool of 16 KiB objects in random LRU order
    # evicted LRU victims until a contiguous MiB formed (3,677 objects here, 4,921 on
    # the model run); now a lease takes free space, or the LRU victim's place
    # only when that one object is large enough.
    pool = shuffled_full_pool(64 * MIB, 16 * KIB)
    assert pool.lease(MIB, "conn") is None
    stats = pool.statistics()
    assert stats.evictions == 0 and stats.leases_refused == 1
    assert stats.live_bytes == stats.capacity_bytes


@pytest.mark.parametrize("big", [64 * KIB, MIB, 4 * MIB])
def test_a_large_object_among_small_ones_evicts_about_its_size(big):
    pool = shuffled_full_pool(64 * MIB, 16 * KIB)
    assert put(pool, "big", big) is GrantStatus.NEW
    stats = pool.statistics()
    assert big <= stats.evicted_bytes <= big + 16 * KIB
    assert stats.evictions_capacity >= 1  # the LRU victim anchors the window
    assert stats.evictions_fragmentation == stats.evictions - stats.evictions_capacity
    pool.allocator.check()


def test_uniform_sizes_evict_exactly_what_they_need_and_stay_lru():
    pool = shuffled_full_pool(16 * MIB, 16 * KIB)
    order = touch_order(16 * MIB // (16 * KIB), 0)[:64]  # the next 64 LRU victims
    for i in range(64):
        assert put(pool, f"new{i}", 16 * KIB) is GrantStatus.NEW
    stats = pool.statistics()
    assert stats.evicted_bytes == 64 * 16 * KIB and stats.evictions_fragmentation == 0
    assert not set(order) & set(pool.keys())  # exactly the LRU victims went


def test_pinned_neighbours_move_the_window_and_are_never_evicted():
    pool = Pool(64 * 16)
    for i in range(16):
        put(pool, i, 64)
    pins = pool.acquire([1, 5, 9, 13], owner="r")  # every fourth object pinned
    assert put(pool, "big", 64 * 3) is GrantStatus.NEW  # fits between two pins
    assert {1, 5, 9, 13} <= set(pool.keys())
    assert pool.statistics().evicted_bytes == 64 * 3
    assert put(pool, "huge", 64 * 4) is GrantStatus.FULL  # no run of 4: nothing evicted
    assert pool.statistics().evicted_bytes == 64 * 3
    pool.release([p.token for p in pins], owner="r")
    pool.allocator.check()


def test_a_lowered_quota_is_met_with_lru_victims_only():
    pool = Pool(64 * 32)
    pool.set_capacity(64 * 16)
    for i in range(16):
        put(pool, i, 64)
    assert put(pool, "big", 64 * 4) is GrantStatus.NEW  # free arena space, over the limit
    stats = pool.statistics()
    assert stats.evictions_capacity == 4 and stats.evictions_fragmentation == 0
    assert set(range(4)).isdisjoint(pool.keys()) and stats.used_bytes == 64 * 16


# ----------------------------------------------------------------- one size: a model

BLOCK = 64 * 2
SLOTS = 24


class UniformMachine(RuleBasedStateMachine):
    """One value size (V1 blocks) with pins (readers, the disk's write-behind),
    leases, deletes and a quota moving: every reserve evicts at most one block (plus
    a lowered limit's excess), a lease at most its LRU victim, and FULL only when
    every block is pinned, reserved or leased."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(BLOCK * SLOTS)
        self.pins: list[int] = []
        self.tokens: list[int] = []
        self.names = iter(range(1 << 30))

    def over(self) -> int:
        s = self.pool.statistics()
        return max(0, s.used_bytes - s.capacity_bytes)

    @rule(commit=st.booleans())
    def reserve(self, commit):
        before, over = self.pool.statistics(), self.over()
        (g,) = self.pool.reserve([next(self.names)], [BLOCK], "w")
        after = self.pool.statistics()
        evicted = after.evicted_bytes - before.evicted_bytes
        assert evicted <= BLOCK + over
        assert after.evictions_fragmentation == 0
        if g.status is GrantStatus.FULL:
            evictable = before.live_bytes - BLOCK * before.pinned
            assert evictable == 0 or (
                before.used_bytes - evictable + BLOCK > before.capacity_bytes)
        elif commit:
            assert self.pool.commit([g.token], "w") == [True]
        else:
            self.tokens.append(g.token)

    @precondition(lambda self: self.tokens)
    @rule()
    def commit_one(self):
        self.pool.commit([self.tokens.pop()], "w")

    @rule(data=st.data())
    def pin(self, data):
        keys = self.pool.keys()
        if keys:
            key = data.draw(st.sampled_from(sorted(keys)))
            self.pins += [p.token for p in self.pool.acquire([key], owner="r")]

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self):
        self.pool.release([self.pins.pop(0)], owner="r")

    @rule(blocks=st.integers(1, 3))
    def lease(self, blocks):
        before = self.pool.statistics()
        off = self.pool.lease(BLOCK * blocks, "c")
        after = self.pool.statistics()
        # at most the LRU victim alone (with the free space beside it), never a window
        assert after.evicted_bytes - before.evicted_bytes <= (BLOCK if off is not None else 0)
        assert after.evictions_fragmentation == 0

    @rule()
    def unlease(self):
        self.pool.drop_owner("c")

    @rule(slots=st.integers(SLOTS // 2, SLOTS))
    def set_capacity(self, slots):
        self.pool.set_capacity(BLOCK * slots)

    @invariant()
    def accounting(self):
        s = self.pool.statistics()
        assert s.used_bytes == s.live_bytes + s.reserved_bytes + s.leased_bytes
        self.pool.allocator.check()


UniformMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestUniformMachine = UniformMachine.TestCase


# ----------------------------------------------------------------- fill

def test_a_pool_that_ran_full_holds_live_objects_in_all_of_its_bytes():
    pool = Pool(16 * MIB)
    pool.lease(pool.capacity_bytes // 64, "conn")  # a connection's lease, kept
    rng = random.Random(1)
    for i in range(5000):
        put(pool, rng.randrange(3000) if i % 3 else f"u{i}", 16 * KIB)
    s = pool.statistics()
    assert s.live_bytes >= 0.98 * s.capacity_bytes
    assert s.live_bytes + s.leased_bytes == s.capacity_bytes


def test_mixed_sizes_fill():
    # V0 values of 16 KiB to 4 MiB in one pool: what a window leaves beside the object
    # it made room for is reused by the next smaller ones (measured: 0.989-0.991 over
    # seeds 2, 3, 4)
    pool = Pool(256 * MIB)
    rng = random.Random(2)
    sizes = [16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB]
    for i in range(6000):
        size = rng.choice(sizes)
        before = pool.statistics().evicted_bytes
        assert put(pool, i, size) is GrantStatus.NEW
        assert pool.statistics().evicted_bytes - before <= size + 4 * MIB
    s = pool.statistics()
    assert s.live_bytes >= 0.98 * s.capacity_bytes, s


def test_statistics_account_for_every_byte():
    pool = Pool(64 * 64)
    put(pool, "a", 100)  # 128 bytes
    (g,) = pool.reserve(["b"], [64], "w")
    off = pool.lease(64 * 4, "c")
    assert off is not None
    s = pool.statistics()
    assert (s.live_bytes, s.reserved_bytes, s.leased_bytes) == (128, 64, 256)
    assert s.used_bytes == 448 and s.free_bytes == 64 * 64 - 448
    assert pool.carve(["c"], [off], [64], "c") == [GrantStatus.NEW]
    assert pool.commit([g.token], "w") == [True]
    s = pool.statistics()
    assert (s.live_bytes, s.reserved_bytes, s.leased_bytes) == (256, 0, 192)
    pool.set_capacity(256)  # evicts for the quota: capacity evictions
    s = pool.statistics()
    # a and c went (c was carved before b was committed)
    assert (s.evictions_capacity, s.evictions, s.evicted_bytes) == (2, 2, 192)
    assert s.free_bytes == 0 and pool.keys() == ["b"]
    pool.drop_owner("c")
    assert pool.statistics().used_bytes == pool.statistics().live_bytes


# ----------------------------------------------------------------- LRU is the floor

@pytest.mark.parametrize("capacity_blocks", [100, 400, 1500])
def test_the_pool_is_exact_lru_on_a_prefix_caching_trace(capacity_blocks):
    trace = synthetic_trace(3000, seed=capacity_blocks)
    lru = lru_hit_rate(trace, capacity_blocks)
    got = replay_pool(Pool(capacity_blocks * 16 * KIB), trace, 16 * KIB)
    assert lru > 0.05  # the trace has reuse to find
    assert got.hit_rate >= 0.99 * lru, (got, lru)
    assert got.fill >= 0.98 or capacity_blocks == 1500
    assert got.evictions_fragmentation == 0


def test_ems_stats_shows_where_the_bytes_are():
    import dataclasses

    from ems.stats import format_report

    pool = Pool(64 * 64)
    put(pool, "a", 64 * 8)
    pool.lease(64 * 4, "c")
    row = dataclasses.asdict(pool.statistics())
    row.update(hit_rate=0.0, connections=1)
    server = {"version": "t", "socket": "s", "pid": 1, "uptime_s": 1.0, "connections": 1,
              "capacity_bytes": 64 * 64, "tenants": 1, "anonymous": True}
    text = format_report({"server": server, "tenants": {"t1": row}})
    lines = text.splitlines()
    at = lines.index("memory:")
    assert lines[at + 1].split() == ["tenant", "live", "reserved", "leased", "free",
                                     "evicted", "capacity", "evicted", "fragmentation",
                                     "leases", "refused", "pages"]
    assert lines[at + 2].split() == ["t1", "512", "B", "0", "B", "256", "B", "3.2", "KiB",
                                     "0", "0", "0", "4", "KiB"]
    old = {k: v for k, v in row.items() if k not in ("live_bytes", "free_bytes")}
    assert "memory:" in format_report({"server": server, "tenants": {"t1": old}})


def test_a_lease_takes_the_place_of_an_lru_victim_that_alone_is_large_enough():
    pool = shuffled_full_pool(64 * MIB, 4 * MIB)  # 16 objects of 4 MiB
    first = touch_order(16, 0)[0]  # the LRU victim
    off = pool.lease(MIB, "conn")
    assert off is not None
    s = pool.statistics()
    assert (s.evictions, s.evictions_capacity, s.evicted_bytes) == (1, 1, 4 * MIB)
    assert first not in pool.keys() and s.leased_bytes == MIB
    assert s.free_bytes == 3 * MIB  # the rest of the victim's place: no more evictions
    assert put(pool, "next", 3 * MIB) is GrantStatus.NEW
    assert pool.statistics().evictions == 1
    pool.allocator.check()
