"""A tenant's quota changed live: ``Pool.set_capacity`` moves the usage limit inside
the fixed arena (the sealed memfd), evicting LRU objects only as far as needed."""

from __future__ import annotations

from ems.pool.core import GrantStatus, Pool

KIB = 1024


def fill(pool: Pool, n: int, size: int = 64 * KIB, prefix: str = "k") -> list[str]:
    keys = [f"{prefix}{i}" for i in range(n)]
    grants = pool.reserve(keys, [size] * n, "w")
    assert all(g.status is GrantStatus.NEW for g in grants)
    assert all(pool.commit([g.token for g in grants], "w"))
    return keys


def test_lowering_evicts_lru_down_to_the_limit_and_keeps_the_rest():
    pool = Pool(1024 * KIB)
    keys = fill(pool, 16)  # the whole arena
    pool.release([p.token for p in pool.acquire(keys[:2], None, "r")], "r")  # k0,k1 recent
    assert pool.set_capacity(512 * KIB) == 512 * KIB
    st = pool.statistics()
    assert st.capacity_bytes == 512 * KIB and st.arena_bytes == 1024 * KIB
    assert st.used_bytes == 512 * KIB and st.objects == 8 and st.evictions == 8
    kept = set(pool.keys())
    assert {"k0", "k1"} <= kept  # the recently used survive
    assert kept == {"k0", "k1", *[f"k{i}" for i in range(10, 16)]}
    pool.allocator.check()


def test_the_limit_holds_for_new_writes_and_raising_gives_the_arena_back():
    pool = Pool(1024 * KIB)
    pool.set_capacity(256 * KIB)
    fill(pool, 4)
    grants = pool.reserve(["x"], [64 * KIB], "w")  # evicts the LRU one, stays at the limit
    assert grants[0].status is GrantStatus.NEW
    assert pool.statistics().used_bytes == 256 * KIB
    assert pool.reserve(["big"], [512 * KIB], "w")[0].status is GrantStatus.TOO_LARGE
    assert pool.statistics().refused_too_large == 1
    assert pool.set_capacity(4096 * KIB) == 1024 * KIB  # capped at the arena
    fill(pool, 12, prefix="m")
    assert pool.statistics().used_bytes == 1024 * KIB
    pool.allocator.check()


def test_pinned_bytes_stay_over_a_lowered_limit_until_released():
    pool = Pool(512 * KIB)
    keys = fill(pool, 8)
    pins = pool.acquire(keys, None, "r")
    assert pool.set_capacity(128 * KIB) == 128 * KIB
    assert pool.statistics().used_bytes == 512 * KIB  # nothing evictable
    assert pool.reserve(["n"], [64 * KIB], "w")[0].status is GrantStatus.FULL
    assert pool.statistics().refused_full == 1
    pool.release([p.token for p in pins], "r")
    g = pool.reserve(["n"], [64 * KIB], "w")[0]  # now evicts down under the limit
    assert g.status is GrantStatus.NEW
    assert pool.statistics().used_bytes <= 128 * KIB
    pool.allocator.check()


def test_miss_reasons_and_bytes_are_counted():
    pool = Pool(1024 * KIB)
    fill(pool, 2)
    pool.reserve(["pending"], [64 * KIB], "w")
    assert pool.acquire(["k0"], [64 * KIB], "r")  # hit
    assert pool.acquire(["nope"], None, "r") == []
    assert pool.acquire(["k1"], [1], "r") == []
    assert pool.acquire(["pending"], None, "r") == []
    st = pool.statistics()
    assert (st.hits, st.misses) == (1, 3)
    assert (st.miss_absent, st.miss_size_mismatch, st.miss_pending) == (1, 1, 1)
    assert st.hit_bytes == 64 * KIB and st.stored_bytes == 128 * KIB
