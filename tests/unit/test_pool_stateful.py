"""Hypothesis state machines: the pool core against a dict model, and real bytes
through the embedded pool and ContextCaching V0 against a dict of values."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ems import CcConfig, CcKvOption, KvBufferWrapper
from ems.client.context_caching import ContextCaching
from ems.client.embedded import EmbeddedTransport
from ems.keys import v0_storage_keys
from ems.pool import GrantStatus, Pool

KEYS = st.sampled_from([f"k{i}" for i in range(8)])
OWNERS = st.sampled_from(["a", "b"])
CAPACITY = 64 * 10  # room for a few objects: eviction happens all the time
TTL = 10.0

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def key_absent(key: str, committed: dict[str, int], busy: set[str]) -> bool:
    return key not in committed and key not in busy


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PoolMachine(RuleBasedStateMachine):
    """Every committed key of the model is in the pool with its size, unless it was
    evictable and got evicted; pinned and reserved keys are never evicted.

    The model also keeps where each object, reservation and lease piece lies, so it
    checks the allocation bound of ``ems.pool.core``: making room for ``need`` bytes
    evicts at most ``need`` + the largest object + what a lowered limit is exceeded
    by; a lease evicts at most one object; FULL only when no run of free and evictable extents of
    ``need`` bytes exists (or the limit cannot be met by evicting everything)."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.pool = Pool(CAPACITY, reservation_ttl_s=TTL, clock=self.clock)
        self.committed: dict[str, int] = {}
        self.reservations: dict[int, tuple[str, int, str, float]] = {}
        self.pins: dict[int, tuple[str, str]] = {}
        #: hold(): token -> (the keys it pinned, owner)
        self.holds: dict[int, tuple[list[str], str]] = {}
        self.leases: dict[str, set[tuple[int, int]]] = {"a": set(), "b": set()}  # pieces
        self.evictions = self.expired = self.hits = self.misses = 0
        self.offsets: dict[str, int] = {}  # committed key -> offset
        self.res_offsets: dict[int, int] = {}  # reservation token -> offset
        self.evicted_bytes = 0
        #: marks of unwritten keys (``mark_unwritten``), per committed key
        self.marks: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------- model helpers
    def pin_count(self, key: str) -> int:
        return (sum(1 for k, _ in self.pins.values() if k == key)
                + sum(1 for keys, _ in self.holds.values() if key in keys))

    def pinned_keys(self) -> set[str]:
        return {k for k, _ in self.pins.values()} | {
            k for keys, _ in self.holds.values() for k in keys}

    def reserved_keys(self) -> set[str]:
        return {k for k, *_ in self.reservations.values()}

    def sync_evictions(self) -> None:
        present = set(self.pool.keys())
        for key in list(self.committed):
            if key not in present:
                assert self.pin_count(key) == 0, f"pinned {key} was evicted"
                self.evicted_bytes += self.rounded(self.committed.pop(key))
                del self.offsets[key]
                self.marks.pop(key, None)
                self.evictions += 1

    def rounded(self, size: int) -> int:
        return self.pool.allocator.round_up(size)

    def layout(self, spare: bool = False) -> list[tuple[int, int, bool]]:
        """The model's arena: (start, size, evictable) of every allocated extent
        (``spare``: objects marked unwritten are not evictable)."""
        used = [(self.offsets[k], self.rounded(n),
                 self.pin_count(k) == 0 and not (spare and self.marks[k] > 0))
                for k, n in self.committed.items()]
        used += [(self.res_offsets[t], self.rounded(r[1]), False)
                 for t, r in self.reservations.items()]
        used += [(o, n, False) for pieces in self.leases.values() for o, n in pieces]
        return sorted(used)

    def placeable(self, need: int, spare: bool = False) -> bool:
        """Whether some run of free and evictable extents holds ``need`` bytes and
        evicting every evictable object would meet the usage limit."""
        layout = self.layout(spare)
        used = sum(n for _, n, _ in layout)
        evictable = sum(n for _, n, e in layout if e)
        if used - evictable + need > self.pool.capacity_bytes:
            return False
        run_start = 0
        for start, size, evictable_here in layout + [(CAPACITY, 0, False)]:
            if not evictable_here:
                if start - run_start >= need:
                    return True
                run_start = start + size
        return False

    def largest_gap(self) -> int:
        """The largest free extent of the model's arena."""
        ends = [0] + [s + n for s, n, _ in self.layout()]
        starts = [s for s, _, _ in self.layout()] + [CAPACITY]
        return max(b - a for a, b in zip(ends, starts))

    # ------------------------------------------------------------- rules
    @rule(batch=st.lists(st.tuples(KEYS, st.integers(1, 64 * 6)), min_size=1, max_size=3,
                         unique_by=lambda item: item[0]),
          owner=OWNERS, commit=st.booleans(), spare=st.booleans(), leading=st.booleans())
    def reserve(self, batch, owner, commit, spare, leading):
        keys, sizes = [k for k, _ in batch], [n for _, n in batch]
        before, busy = dict(self.committed), self.reserved_keys()
        largest = max((self.rounded(n) for n in before.values()), default=0)
        over = max(0, self.pool.statistics().used_bytes - self.pool.capacity_bytes)
        placeable = len(keys) == 1 and key_absent(keys[0], before, busy) and self.placeable(
            self.rounded(sizes[0]), spare)
        evicted_before = self.evicted_bytes
        marked = {k for k, n in self.marks.items() if n > 0}
        grants = self.pool.reserve(keys, sizes, owner, spare_unwritten=spare,
                                   leading=leading)
        if leading:  # up to the first key not granted NEW, that one's grant last
            stop = next((i for i, g in enumerate(grants)
                         if g.status is not GrantStatus.NEW), len(keys) - 1)
            assert len(grants) == stop + 1, "a leading reserve went on past a refusal"
        else:
            assert len(grants) == len(keys)
        present = set(self.pool.keys())
        exists = set()
        for key, size, g in zip(keys, sizes, grants):
            if g.status is GrantStatus.EXISTS:
                assert key in before and g.size == before[key]
                assert key in present, f"{key} was reported stored, then evicted by its batch"
                exists.add(key)
            elif g.status is GrantStatus.BUSY:
                assert key in busy
            elif g.status is GrantStatus.TOO_LARGE:
                assert self.rounded(size) > self.pool.capacity_bytes
            else:  # NEW or FULL: absent, or evicted by an earlier key of this batch
                assert key not in busy and self.rounded(size) <= self.pool.capacity_bytes
                assert key not in before or key not in present
        self.sync_evictions()
        if spare:
            assert marked <= set(self.committed), "a spare reserve evicted an unwritten key"
        # (was: FULL only after everything evictable was evicted. Now FULL only when
        # no window can be made, and making room evicts a bounded number of bytes.)
        if placeable:
            assert grants[0].status is not GrantStatus.FULL, "FULL with a window possible"
        allocating = [self.rounded(n) for n, g in zip(sizes, grants)
                      if g.status in (GrantStatus.NEW, GrantStatus.FULL)]
        assert self.evicted_bytes - evicted_before <= sum(allocating) + len(allocating) * (
            largest) + over, "an allocation evicted more than it needs"
        assert self.pool.statistics().evicted_bytes == self.evicted_bytes
        for key, size, g in zip(keys, sizes, grants):
            if g.status is GrantStatus.NEW:
                assert g.size == size and g.offset % self.pool.allocator.alignment == 0
                self.reservations[g.token] = (key, size, owner, self.clock.now + TTL)
                self.res_offsets[g.token] = g.offset
                if commit:
                    self.do_commit(g.token, owner)

    def do_commit(self, token: int, owner: str) -> None:
        key, size, real_owner, _ = self.reservations[token]
        ok = self.pool.commit([token], owner)
        assert ok == [owner == real_owner]
        if owner == real_owner:
            del self.reservations[token]
            self.committed[key] = size
            self.offsets[key] = self.res_offsets.pop(token)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data(), right_owner=st.booleans())
    def commit(self, data, right_owner):
        token = data.draw(st.sampled_from(sorted(self.reservations)))
        owner = self.reservations[token][2]
        self.do_commit(token, owner if right_owner else owner + "-other")

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def abort(self, data):
        token = data.draw(st.sampled_from(sorted(self.reservations)))
        self.pool.abort([token], self.reservations.pop(token)[2])
        del self.res_offsets[token]

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4, unique=True), owner=OWNERS,
          wrong_size=st.booleans())
    def acquire(self, keys, owner, wrong_size):
        sizes = None
        if wrong_size:
            sizes = [self.committed.get(k, 64) + 1 for k in keys]
        pins = self.pool.acquire(keys, sizes, owner)
        expected = 0
        for k in keys:
            if k not in self.committed or sizes is not None:
                break
            expected += 1
        assert len(pins) == expected
        self.hits += expected
        self.misses += expected < len(keys)
        for k, p in zip(keys, pins):
            assert p.size == self.committed[k]
            self.pins[p.token] = (k, owner)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def release(self, data):
        token = data.draw(st.sampled_from(sorted(self.pins)))
        self.pool.release([token], self.pins.pop(token)[1])

    @rule(keys=st.lists(KEYS, min_size=1, max_size=5), owner=OWNERS)
    def hold(self, keys, owner):
        """Every committed key, each once, in the order asked (absent ones skipped),
        under one token (0 when none is here)."""
        held = self.pool.hold(keys, owner)
        want = [k for k in dict.fromkeys(keys) if k in self.committed]
        assert held.keys == want
        assert held.sizes == [self.committed[k] for k in want]
        assert held.offsets == [self.offsets[k] for k in want]
        assert (held.token == 0) == (not want)
        if want:
            self.holds[held.token] = (want, owner)

    @precondition(lambda self: self.holds)
    @rule(data=st.data(), wrong_owner=st.booleans())
    def release_held(self, data, wrong_owner):
        token = data.draw(st.sampled_from(sorted(self.holds)))
        keys, owner = self.holds[token]
        if wrong_owner:
            other = "b" if owner == "a" else "a"
            assert self.pool.release_held(token, other) == 0
            return
        assert self.pool.release_held(token, owner) == len(keys)
        del self.holds[token]

    @rule(key=KEYS, unwritten=st.booleans())
    def mark(self, key, unwritten):
        if unwritten:
            self.pool.mark_unwritten([key])
            if key in self.committed:
                self.marks[key] += 1
        else:
            self.pool.mark_written([key])
            if self.marks[key] > 0:
                self.marks[key] -= 1
        for k in self.committed:
            assert self.pool.unwritten(k) is (self.marks[k] > 0)

    @rule(key=KEYS)
    def delete(self, key):
        expected = key in self.committed and self.pin_count(key) == 0
        assert self.pool.delete(key) is expected
        if expected:
            del self.committed[key]
            del self.offsets[key]
            self.marks.pop(key, None)

    @rule(dt=st.floats(0, 2 * TTL))
    def tick_and_expire(self, dt):
        self.clock.now += dt
        stale = [t for t, r in self.reservations.items() if r[3] <= self.clock.now]
        assert self.pool.expire() == len(stale)
        for t in stale:
            del self.reservations[t]
            del self.res_offsets[t]
        self.expired += len(stale)

    @rule(owner=OWNERS, blocks=st.integers(1, 4))
    def lease(self, owner, blocks):
        used = sum(n for _, n, _ in self.layout())
        free_fits = (used + 64 * blocks <= self.pool.capacity_bytes
                     and self.largest_gap() >= 64 * blocks)
        largest = max((self.rounded(n) for n in self.committed.values()), default=0)
        off = self.pool.lease(64 * blocks, owner)
        evictions, evicted = self.evictions, self.evicted_bytes
        self.sync_evictions()
        # (was: a lease evicts like a reservation.) A lease takes free space, or the
        # place of the LRU victim alone: at most one object, never scattered ones.
        assert self.evictions - evictions <= (1 if off is not None else 0), "a lease evicted"
        assert self.evicted_bytes - evicted <= largest
        if free_fits:
            assert off is not None
        if off is not None:
            assert off % 64 == 0
            self.leases[owner].add((off, 64 * blocks))

    def draw_range(self, data):
        """An owner, one of its pieces, and an aligned range inside it."""
        owner = data.draw(st.sampled_from(sorted(o for o, p in self.leases.items() if p)))
        start, size = data.draw(st.sampled_from(sorted(self.leases[owner])))
        first = data.draw(st.integers(0, size // 64 - 1))
        blocks = data.draw(st.integers(1, size // 64 - first))
        return owner, (start, size), start + 64 * first, 64 * blocks

    def cut(self, owner, piece, offset, need):
        start, size = piece
        self.leases[owner].remove(piece)
        if offset > start:
            self.leases[owner].add((start, offset - start))
        if offset + need < start + size:
            self.leases[owner].add((offset + need, start + size - offset - need))

    @precondition(lambda self: any(self.leases.values()))
    @rule(data=st.data(), key=KEYS)
    def carve(self, data, key):
        owner, piece, offset, need = self.draw_range(data)
        size = data.draw(st.integers(need - 63, need))
        (status,) = self.pool.carve([key], [offset], [size], owner)
        if key in self.committed:
            assert status is GrantStatus.EXISTS
        elif key in self.reserved_keys():
            assert status is GrantStatus.BUSY
        else:
            assert status is GrantStatus.NEW
            self.committed[key] = size
            self.offsets[key] = offset
        self.cut(owner, piece, offset, need)

    @precondition(lambda self: any(self.leases.values()))
    @rule(data=st.data(), wrong_owner=st.booleans())
    def carve_outside_the_lease(self, data, wrong_owner):
        owner, piece, offset, need = self.draw_range(data)
        if wrong_owner:
            owner = "b" if owner == "a" else "a"
            if any(s <= offset < s + n for s, n in self.leases[owner]):
                return
        else:
            need = piece[0] + piece[1] - offset + 64  # one block past the piece
        before = self.pool.statistics()
        with pytest.raises(ValueError):
            self.pool.carve(["k0"], [offset], [need], owner)
        assert self.pool.statistics() == before

    @precondition(lambda self: any(self.leases.values()))
    @rule(data=st.data())
    def unlease(self, data):
        owner, piece, offset, need = self.draw_range(data)
        self.pool.unlease([offset], [need], owner)
        self.cut(owner, piece, offset, need)

    @rule(limit=st.integers(0, CAPACITY + 128))
    def set_capacity(self, limit):
        """A quota changed live: the usage limit moves inside the fixed arena."""
        got = self.pool.set_capacity(limit)
        assert got == min(limit, CAPACITY) // 64 * 64 == self.pool.capacity_bytes
        self.sync_evictions()
        if self.pool.statistics().used_bytes > got:  # only what cannot be evicted is left
            assert all(self.pin_count(k) for k in self.committed)

    @rule(owner=OWNERS)
    def drop_owner(self, owner):
        self.pool.drop_owner(owner)
        self.leases[owner] = set()
        self.reservations = {t: r for t, r in self.reservations.items() if r[2] != owner}
        self.res_offsets = {t: o for t, o in self.res_offsets.items() if t in self.reservations}
        self.pins = {t: p for t, p in self.pins.items() if p[1] != owner}
        self.holds = {t: h for t, h in self.holds.items() if h[1] != owner}

    # ------------------------------------------------------------- invariants
    @invariant()
    def allocator_tiles_the_arena(self):
        self.pool.allocator.check()

    @invariant()
    def model_matches_the_pool(self):
        stats = self.pool.statistics()
        assert stats.used_bytes <= stats.arena_bytes == CAPACITY  # a lowered limit can be
        assert stats.capacity_bytes <= CAPACITY                   # exceeded by pinned bytes
        assert set(self.pool.keys()) == set(self.committed)
        for key, size in self.committed.items():
            assert self.pool.exists([key], [size]) == 1
        expected_used = sum(self.rounded(s) for s in self.committed.values()) + sum(
            self.rounded(r[1]) for r in self.reservations.values())
        leased = sum(n for pieces in self.leases.values() for _, n in pieces)
        assert stats.used_bytes == expected_used + leased
        assert stats.leased_bytes == leased
        assert stats.live_bytes == sum(self.rounded(s) for s in self.committed.values())
        assert stats.reserved_bytes == sum(self.rounded(r[1]) for r in self.reservations.values())
        assert stats.used_bytes == stats.live_bytes + stats.reserved_bytes + stats.leased_bytes
        assert stats.free_bytes == max(0, stats.capacity_bytes - stats.used_bytes)
        assert stats.evictions == stats.evictions_capacity + stats.evictions_fragmentation
        assert stats.free_bytes + stats.used_bytes >= stats.capacity_bytes
        assert stats.objects == len(self.committed)
        assert stats.reserved == len(self.reservations)
        assert stats.pinned == len(self.pinned_keys())
        assert stats.evictions == self.evictions
        assert stats.expired_reservations == self.expired
        assert (stats.hits, stats.misses) == (self.hits, self.misses)

    def teardown(self):
        for token, (_, owner) in list(self.pins.items()):
            self.pool.release([token], owner)
        for token, (_, owner) in list(self.holds.items()):
            self.pool.release_held(token, owner)
        for token, r in list(self.reservations.items()):
            self.pool.abort([token], r[2])
        for owner in self.leases:
            self.pool.drop_owner(owner)
        self.pool.allocator.check()
        assert self.pool.allocator.used_bytes == sum(
            self.rounded(s) for s in self.committed.values())


PoolMachine.TestCase.settings = SETTINGS
TestPoolMachine = PoolMachine.TestCase


# --------------------------------------------------------------------- real bytes

class V0BytesMachine(RuleBasedStateMachine):
    """Loads return the value stored under a key or miss; a miss writes nothing.

    Write-once: saving a stored key keeps its value. Eviction may drop a key at any
    save, even one of the same batch before the batch reaches it (the key is then
    stored anew with the new value), so after a save that evicted, a re-saved key
    may hold either value: the model keeps the candidates and narrows them by size
    (``Pool.exists`` with a size) and by the next load's bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.transport = EmbeddedTransport(8 << 10)
        self.cc = ContextCaching(self.transport, CcConfig(0, 0, "m"), None, workers=2)
        self.model: dict[str, set[bytes]] = {}

    @initialize()
    def started(self):
        assert self.cc.statistics().objects == 0

    def storage(self, key: str) -> str:
        return v0_storage_keys([key])[0]

    def settle(self) -> None:
        """Pins are released just after a load answers: wait for that. Then drop the
        keys the pool evicted, and the candidates of another size."""
        deadline = time.monotonic() + 5
        while True:
            stats = self.cc.statistics()
            if stats.pinned == 0 and stats.reserved == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.001)
        pool = self.transport.pool
        for key in list(self.model):
            sk = self.storage(key)
            if not pool.exists([sk]):
                del self.model[key]
                continue
            self.model[key] = {v for v in self.model[key] if pool.exists([sk], [len(v)])}
            assert self.model[key], f"{key} holds none of the values saved under it"

    @rule(sized=st.dictionaries(KEYS, st.tuples(st.integers(1, 4000), st.integers(0, 255)),
                                min_size=1, max_size=3),
          split=st.booleans(), use_async=st.booleans())
    def save(self, sized, split, use_async):
        keys = list(sized)
        arrays = [np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
                  for n, seed in sized.values()]
        values = []
        for a in arrays:
            if split and a.size > 1:  # the same value as two buffers
                h = a.size // 2
                values.append([KvBufferWrapper(a.ctypes.data, h),
                               KvBufferWrapper(a.ctypes.data + h, a.size - h)])
            else:
                values.append([KvBufferWrapper(a.ctypes.data, a.size)])
        opt = CcKvOption()
        before = self.cc.statistics()
        largest_free = self.transport.pool.allocator.largest_free()
        need = sum(self.transport.pool.allocator.round_up(a.size)
                   for k, a in zip(keys, arrays) if k not in self.model)
        if use_async:
            result = self.cc.async_save(opt, keys, values).result()
        else:
            result = self.cc.save(opt, keys, values)
        assert result.total == len(keys)
        evicted = self.cc.statistics().evictions != before.evictions
        if not evicted and need <= largest_free:
            # the new keys fit in one free extent (each allocation finds room, in it or
            # elsewhere): nothing can have failed. (Free space of several smaller
            # extents is no such promise: when the only evictable object is one this
            # batch holds as EXISTS, a key that fits no extent is FULL, by design.)
            assert result.success == len(keys)
        pool = self.transport.pool
        for i, (key, a) in enumerate(zip(keys, arrays)):
            stored = bool(pool.exists([self.storage(key)]))
            if i < result.success:
                assert stored, f"{key} was reported saved but is not in the pool"
            if not stored:
                self.model.pop(key, None)
            elif key not in self.model:
                self.model[key] = {a.tobytes()}
            elif evicted:
                self.model[key].add(a.tobytes())
            # else: write-once, the stored value stays
        self.settle()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def load_saved(self, data):
        """Mostly hits: the keys the model holds, in a random order."""
        keys = data.draw(st.permutations(sorted(self.model)))
        self.load(keys[:4], wrong_length=False)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4, unique=True),
          wrong_length=st.booleans())
    def load_any(self, keys, wrong_length):
        self.load(keys, wrong_length)

    def load(self, keys, wrong_length):
        lengths = [len(next(iter(self.model[k]))) if k in self.model else 17 for k in keys]
        lengths = [n + 1 if wrong_length else n for n in lengths]
        outs = [np.full(n, 0xEE, dtype=np.uint8) for n in lengths]
        result = self.cc.load(CcKvOption(), keys,
                              [[KvBufferWrapper(o.ctypes.data, o.size)] for o in outs])
        expected = 0
        for k in keys:
            if k not in self.model or wrong_length:
                break
            expected += 1
        assert (result.success, result.total) == (expected, len(keys))
        for i, (k, o) in enumerate(zip(keys, outs)):
            if i < expected:
                got = o.tobytes()
                assert got in self.model[k], f"{k} came back with bytes never saved"
                self.model[k] = {got}
            else:
                assert (o == 0xEE).all(), "a miss wrote into the caller's buffer"
        self.settle()

    @invariant()
    def pool_is_consistent(self):
        self.transport.pool.allocator.check()
        stats = self.cc.statistics()
        assert stats.used_bytes <= stats.capacity_bytes
        assert stats.objects == len(self.model)

    def teardown(self):
        self.cc.close()
        self.transport.close()


V0BytesMachine.TestCase.settings = settings(SETTINGS, max_examples=30,
                                            stateful_step_count=25)
TestV0BytesMachine = V0BytesMachine.TestCase
