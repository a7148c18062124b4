"""The pool core (no I/O, fake clock): write-once reservations, visibility at commit,
pins, LRU eviction, reservation TTL, owners, statistics."""

from __future__ import annotations

import pytest

from ems.pool import GrantStatus, LruPolicy, Pool


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool(clock) -> Pool:
    p = Pool(64 * 16, reservation_ttl_s=10.0, clock=clock)
    yield p
    p.allocator.check()


def put(pool: Pool, key, size=64, owner=None) -> None:
    (g,) = pool.reserve([key], [size], owner)
    assert g.status is GrantStatus.NEW
    assert pool.commit([g.token], owner) == [True]


# ----------------------------------------------------------------- LRU policy

def test_lru_policy_order():
    lru = LruPolicy()
    assert lru.victim() is None and len(lru) == 0
    for k in "abc":
        lru.insert(k)
    assert lru.victim() == "a"
    lru.touch("a")
    assert lru.victim() == "b"
    lru.remove("b")
    lru.remove("zzz")  # absent: no error
    lru.touch("zzz")  # absent: not inserted
    assert lru.victim() == "c" and len(lru) == 2
    lru.insert("c")  # re-insert moves to the end
    assert lru.victim() == "a"
    assert lru.pop_victim() == "a" and lru.pop_victim() == "c"  # removed as taken
    assert lru.pop_victim() is None and lru.victim() is None and len(lru) == 0


def test_insert_all_is_insert_of_each_key_in_order():
    def orders(lru: LruPolicy) -> tuple[list, list]:
        return list(lru._order), list(lru._unwritten)

    for batch in (["x", "y"], ["x", "b", "y"], ["y", "a"]):  # fresh; one listed; marked
        one, many = LruPolicy(), LruPolicy()
        for lru in (one, many):
            for k in "abc":
                lru.insert(k)
            if batch == ["y", "a"]:
                lru.mark_all(["a"], True)
        for k in batch:
            one.insert(k)
        many.insert_all(batch)
        assert orders(many) == orders(one)


# ----------------------------------------------------------------- writes and reads

def test_reserve_commit_acquire_release(pool):
    (g,) = pool.reserve(["k"], [100], owner="w")
    assert g.status is GrantStatus.NEW and g.size == 100 and g.offset % 64 == 0
    assert pool.statistics().reserved == 1
    assert pool.commit([g.token], owner="w") == [True]
    pins = pool.acquire(["k"], [100], owner="r")
    assert len(pins) == 1 and (pins[0].offset, pins[0].size) == (g.offset, 100)
    stats = pool.statistics()
    assert (stats.objects, stats.reserved, stats.pinned, stats.hits) == (1, 0, 1, 1)
    pool.release([pins[0].token], owner="r")
    assert pool.statistics().pinned == 0


def test_a_reader_sees_nothing_before_commit(pool):
    (g,) = pool.reserve(["k"], [64])
    assert pool.acquire(["k"]) == []
    assert pool.exists(["k"]) == 0
    assert pool.keys() == []
    pool.commit([g.token])
    assert pool.exists(["k"]) == 1 and pool.keys() == ["k"]


def test_write_once_exists_and_busy(pool):
    (g,) = pool.reserve(["k"], [64], owner="a")
    (busy,) = pool.reserve(["k"], [64], owner="b")
    assert busy.status is GrantStatus.BUSY
    pool.commit([g.token], owner="a")
    (again,) = pool.reserve(["k"], [128], owner="b")
    assert again.status is GrantStatus.EXISTS and again.size == 64
    assert pool.statistics().objects == 1


def test_commit_and_abort_check_the_owner(pool):
    (g,) = pool.reserve(["k"], [64], owner="a")
    assert pool.commit([g.token], owner="b") == [False]
    pool.abort([g.token], owner="b")  # ignored
    assert pool.statistics().reserved == 1
    pool.abort([g.token], owner="a")
    assert pool.statistics().reserved == 0 and pool.allocator.used_bytes == 0
    assert pool.commit([g.token], owner="a") == [False]
    assert pool.commit([424242]) == [False]


def test_acquire_stops_at_the_first_miss_and_counts(pool):
    for k in ("a", "b", "d"):
        put(pool, k)
    pins = pool.acquire(["a", "b", "c", "d"])
    assert len(pins) == 2
    stats = pool.statistics()
    assert (stats.hits, stats.misses) == (2, 1)
    assert stats.hit_rate == pytest.approx(2 / 3)
    pool.release([p.token for p in pins])


def test_acquire_with_another_size_is_a_miss(pool):
    put(pool, "k", size=100)
    assert pool.acquire(["k"], [99]) == []
    assert pool.exists(["k"], [99]) == 0 and pool.exists(["k"], [100]) == 1
    assert len(pool.acquire(["k"], [None])) == 1


def test_exists_does_not_count_or_pin(pool):
    put(pool, "k")
    assert pool.exists(["k", "x"]) == 1
    stats = pool.statistics()
    assert (stats.hits, stats.misses, stats.pinned) == (0, 0, 0)


def test_release_checks_the_owner_and_is_idempotent(pool):
    put(pool, "k")
    (pin,) = pool.acquire(["k"], owner="r")
    pool.release([pin.token], owner="other")
    assert pool.statistics().pinned == 1
    pool.release([pin.token], owner="r")
    pool.release([pin.token], owner="r")
    assert pool.statistics().pinned == 0


def test_delete(pool):
    put(pool, "k")
    (pin,) = pool.acquire(["k"])
    assert pool.delete("k") is False  # pinned
    pool.release([pin.token])
    assert pool.delete("k") is True
    assert pool.delete("k") is False
    (g,) = pool.reserve(["r"], [64])
    assert pool.delete("r") is False  # reserved, not committed
    assert pool.allocator.used_bytes == 64


# ----------------------------------------------------------------- eviction

def test_a_leading_reserve_stops_at_the_first_refusal_and_evicts_nothing_after(pool):
    for i in range(15):  # full: every new key evicts one, the oldest first
        put(pool, i)
    put(pool, "stored")
    grants = pool.reserve(["a", "stored", "b", "c"], [64] * 4, "tier", leading=True)
    assert [g.status for g in grants] == [GrantStatus.NEW, GrantStatus.EXISTS]
    stats = pool.statistics()
    assert stats.reserved == 1 and stats.evictions == 1  # "b" and "c" evicted nothing
    assert "b" not in pool.keys() and "c" not in pool.keys()
    # without it, every key gets its grant (and makes its room)
    grants = pool.reserve(["d", "stored", "e"], [64] * 3, "tier")
    assert [g.status for g in grants] == [GrantStatus.NEW, GrantStatus.EXISTS,
                                          GrantStatus.NEW]
    # a run that ends on a key too large for the pool: its grant is the last
    grants = pool.reserve(["f", "huge", "g"], [64, 64 * 17, 64], "tier", leading=True)
    assert [g.status for g in grants] == [GrantStatus.NEW, GrantStatus.TOO_LARGE]


def test_lru_eviction_when_full(pool):
    for i in range(16):
        put(pool, i)
    assert pool.allocator.free_bytes == 0
    pins = pool.acquire([0])  # a reader touches 0
    pool.release([p.token for p in pins])
    put(pool, "new")
    assert 1 not in pool.keys() and 0 in pool.keys()
    assert pool.statistics().evictions == 1


def test_the_pool_evicts_the_victims_of_the_policy_it_was_given(clock):
    class NewestFirst(LruPolicy):
        def pop_victim(self):
            key = next(reversed(self._order), None)
            if key is not None:
                self.remove(key)
            return key

    pool = Pool(64 * 16, clock=clock, policy=NewestFirst)
    for i in range(16):
        put(pool, i)
    put(pool, "new")
    assert 15 not in pool.keys() and 0 in pool.keys() and "new" in pool.keys()
    assert Pool(64, clock=clock)._policy is not Pool(64, clock=clock)._policy
    pool.allocator.check()


def test_reserve_of_an_existing_key_refreshes_it(pool):
    for i in range(16):
        put(pool, i)
    assert pool.reserve([0], [64])[0].status is GrantStatus.EXISTS
    put(pool, "new")
    assert 0 in pool.keys() and 1 not in pool.keys()


def test_eviction_frees_enough_for_a_large_object(pool):
    for i in range(16):
        put(pool, i)
    put(pool, "big", size=64 * 3)
    assert pool.statistics().evictions == 3
    assert pool.allocator.used_bytes == pool.capacity_bytes
    assert set(pool.keys()) == set(range(3, 16)) | {"big"}


def test_pins_prevent_eviction(pool):
    for i in range(16):
        put(pool, i)
    pins = pool.acquire(list(range(16)))
    assert len(pins) == 16
    (g,) = pool.reserve(["new"], [64])
    assert g.status is GrantStatus.FULL
    assert pool.statistics().evictions == 0
    pool.release([pins[5].token])
    (g,) = pool.reserve(["new"], [64])
    assert g.status is GrantStatus.NEW
    assert 5 not in pool.keys()
    pool.release([p.token for p in pins if p is not pins[5]])


def test_reservations_are_not_evicted(pool):
    grants = pool.reserve(list(range(16)), [64] * 16)
    assert all(g.status is GrantStatus.NEW for g in grants)
    assert pool.reserve(["x"], [64])[0].status is GrantStatus.FULL


def test_too_large(pool):
    put(pool, "k")
    (g,) = pool.reserve(["huge"], [64 * 17])
    assert g.status is GrantStatus.TOO_LARGE
    assert pool.keys() == ["k"] and pool.statistics().evictions == 0


# ----------------------------------------------------------------- lifecycle

def test_reservation_ttl_expires_with_the_clock(pool, clock):
    (g,) = pool.reserve(["slow"], [64], owner="w")
    clock.now += 9.9
    assert pool.expire() == 0
    clock.now += 0.2
    assert pool.expire() == 1
    stats = pool.statistics()
    assert (stats.reserved, stats.expired_reservations, stats.used_bytes) == (0, 1, 0)
    assert pool.commit([g.token], owner="w") == [False]  # too late
    assert pool.exists(["slow"]) == 0
    (g2,) = pool.reserve(["slow"], [64], owner="w2")  # the key is free again
    assert g2.status is GrantStatus.NEW


def test_expire_with_an_explicit_time(pool, clock):
    pool.reserve(["a"], [64])
    clock.now += 5
    pool.reserve(["b"], [64])
    assert pool.expire(now=clock.now + 6) == 1  # only "a" is older than 10 s
    assert pool.statistics().reserved == 1


def test_committed_objects_never_expire(pool, clock):
    put(pool, "k")
    clock.now += 3600
    assert pool.expire() == 0 and pool.keys() == ["k"]


def test_drop_owner_ends_reservations_and_pins(pool):
    put(pool, "shared")
    pool.reserve(["w1", "w2"], [64, 64], owner="gone")
    pool.acquire(["shared"], owner="gone")
    (keep,) = pool.acquire(["shared"], owner="alive")
    pool.reserve(["w3"], [64], owner="alive")
    pool.drop_owner("gone")
    stats = pool.statistics()
    assert (stats.reserved, stats.pinned) == (1, 1)
    assert pool.reserve(["w1"], [64])[0].status is GrantStatus.NEW
    pool.release([keep.token], owner="alive")
    assert pool.delete("shared") is True


def test_statistics_are_a_frozen_snapshot(pool):
    import dataclasses

    s = pool.statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.used_bytes = 1  # type: ignore[misc]
    assert s.hit_rate == 0.0
    put(pool, "k")
    assert s.objects == 0 and pool.statistics().objects == 1


def test_a_batch_never_evicts_a_key_it_reported_as_stored(pool):
    for i in range(16):
        put(pool, i)
    pins = pool.acquire([i for i in range(16) if i != 5])  # only 5 is evictable
    assert len(pins) == 15
    grants = pool.reserve([5, "new"], [64, 64])
    assert [g.status for g in grants] == [GrantStatus.EXISTS, GrantStatus.FULL]
    assert 5 in pool.keys() and pool.statistics().evictions == 0
    pool.release([p.token for p in pins])
    # after the batch, 5 is evictable again (the least recently used now)
    (g,) = pool.reserve(["new"], [64])
    assert g.status is GrantStatus.NEW and 5 not in pool.keys()


# ----------------------------------------------------------------- leases

def test_a_lease_is_carved_into_committed_objects(pool):
    off = pool.lease(64 * 8, "c")
    assert off is not None
    stats = pool.statistics()
    assert stats.leased_bytes == 64 * 8 and stats.used_bytes == 64 * 8 and stats.objects == 0
    # out of order, as concurrent writers' Puts arrive
    assert pool.carve(["b", "a"], [off + 128, off], [100, 64], "c") == [GrantStatus.NEW] * 2
    assert pool.exists(["a", "b"], [64, 100]) == 2
    (pin,) = pool.acquire(["b"], None, "r")
    assert (pin.offset, pin.size) == (off + 128, 100)
    pool.release([pin.token], "r")
    stats = pool.statistics()
    assert stats.leased_bytes == 64 * 5 and stats.used_bytes == 64 * 8 and stats.objects == 2
    pool.allocator.check()
    # carved objects are ordinary: deleted / evicted on their own
    assert pool.delete("a")
    pool.allocator.check()
    pool.drop_owner("c")  # the rest of the lease goes; "b" stays
    stats = pool.statistics()
    assert stats.leased_bytes == 0 and stats.used_bytes == 128 and pool.keys() == ["b"]


def test_carve_of_a_stored_or_reserved_key_frees_the_range(pool):
    put(pool, "old")
    (g,) = pool.reserve(["busy"], [64], "w")
    off = pool.lease(64 * 4, "c")
    used = pool.statistics().used_bytes
    assert pool.carve(["old", "busy", "new"], [off, off + 64, off + 128], [64, 64, 64],
                      "c") == [GrantStatus.EXISTS, GrantStatus.BUSY, GrantStatus.NEW]
    stats = pool.statistics()
    assert stats.used_bytes == used - 128 and stats.leased_bytes == 64
    assert pool.commit([g.token], "w") == [True]  # the writer's reservation is untouched
    pool.allocator.check()


@pytest.mark.parametrize("case", ["foreign", "outside", "overlap", "unaligned", "zero",
                                  "no-lease", "carved"])
def test_carve_outside_the_own_lease_is_refused_and_changes_nothing(pool, case):
    off = pool.lease(64 * 4, "c")
    other = pool.lease(64 * 4, "d")
    pool.carve(["first"], [off + 192], [64], "c")
    ranges = {"foreign": ([other], [64]), "outside": ([off + 128], [128]),
              "overlap": ([off, off + 64], [128, 64]), "unaligned": ([off + 8], [8]),
              "zero": ([off], [0]), "no-lease": ([off], [64]), "carved": ([off + 192], [64])}
    offsets, sizes = ranges[case]
    owner = "nobody" if case == "no-lease" else "c"
    before = pool.statistics()
    with pytest.raises(ValueError):
        pool.carve([f"x{i}" for i in range(len(offsets))], offsets, sizes, owner)
    assert pool.statistics() == before and pool.keys() == ["first"]


def test_unlease_frees_ranges_and_ignores_what_is_not_leased(pool):
    off = pool.lease(64 * 4, "c")
    pool.carve(["k"], [off], [64], "c")
    pool.unlease([off, off + 64, off + 192, off + 8], [64, 64, 64, 8], "c")  # 1st: carved
    pool.unlease([off + 128], [64], "other")  # not its lease
    stats = pool.statistics()
    assert stats.leased_bytes == 64 and stats.used_bytes == 128
    pool.allocator.check()
    pool.drop_owner("c")
    assert pool.statistics().used_bytes == 64


def test_a_lease_never_evicts_and_is_never_evicted(pool):
    # (was: a lease evicts like a reservation. A lease is one extent of many values'
    # size; making it on a full pool of small objects evicted scattered victims until
    # a contiguous range formed, up to half the pool: issue 26.)
    for i in range(16):
        put(pool, f"k{i}")
    assert pool.lease(64 * 4, "c") is None  # full: no free extent, and no eviction
    stats = pool.statistics()
    assert stats.evictions == 0 and stats.leases_refused == 1 and len(pool.keys()) == 16
    for i in range(4, 8):
        assert pool.delete(f"k{i}")
    off = pool.lease(64 * 4, "c")
    assert off == 64 * 4 and pool.statistics().evictions == 0
    assert pool.lease(64 * 16, "c") is None  # the first lease cannot be evicted
    (g,) = pool.reserve(["big"], [64 * 13], "w")
    assert g.status is GrantStatus.FULL and pool.statistics().evictions == 0
    pool.drop_owner("c")
    (g,) = pool.reserve(["big"], [64 * 13], "w")
    assert g.status is GrantStatus.NEW
    pool.abort([g.token], "w")


def test_hold_pins_every_present_key_without_counting(pool):
    for k in ("a", "c"):
        put(pool, k)
    held = pool.hold(["a", "b", "c", "a"], owner="r")
    assert held.keys == ["a", "c"]  # absent keys skipped, each key once, in order
    stats = pool.statistics()
    assert stats.pinned == 2 and stats.hits == 0 and stats.misses == 0
    assert not pool.delete("c")  # pinned: not deleted, not evicted
    assert held.sizes == [64, 64] and held.offsets[0] != held.offsets[1]
    assert pool.release_held(held.token, owner="w") == 0  # another owner's: ignored
    assert pool.release([held.token], owner="r") == 0  # not a pin of acquire's
    assert pool.release_held(held.token, owner="r") == 2  # one token for all
    assert pool.release_held(held.token, owner="r") == 0  # once
    assert pool.statistics().pinned == 0
    assert pool.delete("c")
    assert pool.hold(["b"], owner="r") == (0, [], [], [])  # nothing held: no token


def test_a_hold_and_a_pin_of_one_key_count_apart(pool):
    put(pool, "a")
    held = pool.hold(["a"], owner="r")
    (pin,) = pool.acquire(["a"], None, "r")
    assert pool.release_held(held.token, owner="r") == 1
    assert not pool.delete("a")  # still pinned by the acquire
    pool.drop_owner("r")  # ends both kinds
    assert pool.statistics().pinned == 0 and pool.delete("a")
    put(pool, "b")
    held = pool.hold(["b"], owner="s")
    pool.drop_owner("s")
    assert pool.release_held(held.token, owner="s") == 0 and pool.delete("b")


@pytest.mark.parametrize("pin", ["hold", "acquire"])
def test_a_pinned_victim_is_skipped_then_evictable_again(clock, pin):
    """A pin leaves its object in the LRU order (no reordering per pin); eviction
    that meets it skips it (parks it), and its release makes it evictable again,
    the most recently used, as a release did when pins took objects out."""
    pool = Pool(64 * 3, reservation_ttl_s=10.0, clock=clock)
    for k in ("a", "b", "c"):
        put(pool, k)
    if pin == "hold":
        token = pool.hold(["a"], owner="r").token
    else:
        (p,) = pool.acquire(["a"], None, "r")  # a hit: a is the most recent now
        for k in ("b", "c"):  # two more hits: a is the LRU victim again, pinned
            pool.release([t for t, *_ in pool.acquire([k], None, "r")], "r")
    put(pool, "d")  # evicts b, not the pinned a
    assert sorted(pool.keys()) == ["a", "c", "d"]
    put(pool, "e")  # c; a was parked, not met again
    assert sorted(pool.keys()) == ["a", "d", "e"]
    (g,) = pool.reserve(["f"], [64 * 3])  # the whole arena, a in it: no window
    assert g.status is GrantStatus.FULL and sorted(pool.keys()) == ["a", "d", "e"]
    if pin == "hold":
        assert pool.release_held(token, owner="r") == 1
    else:
        assert pool.release([p.token], owner="r") == 1
    assert pool.statistics().pinned == 0
    for k, evicted in (("f", "d"), ("g", "e"), ("h", "a")):  # a last: released last
        put(pool, k)
        assert evicted not in pool.keys()
    assert sorted(pool.keys()) == ["f", "g", "h"]
    pool.allocator.check()
