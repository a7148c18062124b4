"""The disk index (``ems.disk.index.DiskIndex``) against a model: a dict of what was
written last per key, the regions in least-recently-used order, and which regions were
evicted. The index must return exactly the model's location for every key whose region
is still there, nothing for the others, never evict a region with a write in flight,
evict least recently used first, and stay within the capacity and each quota."""

from __future__ import annotations

from unittest import mock

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ems.disk import index as index_module
from ems.disk.index import DiskIndex, Location, Refusal, Reservation
from ems.disk.records import ALIGN

REGION = 8 * ALIGN
CAPACITY = 5 * REGION
TENANTS = ["a", "b", "c"]
KEYS = ["k0", "k1", "k2", "k3", "k4", "k5"]


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = DiskIndex(CAPACITY, REGION)
        self.written: dict[tuple[str, str], Location] = {}
        self.lru: list[int] = []  # region ids, least recently used first
        self.owner: dict[int, str] = {}
        self.ends: dict[int, int] = {}
        self.pending: list[tuple[Reservation, str]] = []
        self.evicted: set[int] = set()
        self.quota: dict[str, int] = {}
        self.seq = 0

    def _busy(self, region: int) -> bool:
        return any(r.region == region for r, _ in self.pending)

    def _move_to_end(self, region: int) -> None:
        if region in self.lru:
            self.lru.remove(region)
            self.lru.append(region)

    @rule(tenant=st.sampled_from(TENANTS), key=st.sampled_from(KEYS),
          blocks=st.integers(1, 9))
    def reserve(self, tenant, key, blocks):
        span = blocks * ALIGN
        used = sum(self.ends.values())
        got = self.index.reserve(tenant, span)
        if isinstance(got, Refusal):
            quota = self.quota.get(tenant)
            if got is Refusal.TOO_LARGE:
                assert span > REGION or (quota is not None and span > quota)
                return
            free_able = sum(e for r, e in self.ends.items()
                            if not self._busy(r) and (got is Refusal.NO_SPACE
                                                      or self.owner[r] == tenant))
            if got is Refusal.QUOTA:
                mine = sum(e for r, e in self.ends.items() if self.owner[r] == tenant)
                assert quota is not None and mine - free_able + span > quota
            else:
                assert used - free_able + span > CAPACITY
            return
        for e in got.evicted:  # least recently used first, never a busy region
            assert not self._busy(e.region)
            candidates = [r for r in self.lru if not self._busy(r)
                          and r not in self.evicted]
            mine = [r for r in candidates if self.owner[r] == tenant]
            assert e.region in (candidates[:1] + mine[:1]), (e, self.lru)
            self.evicted.add(e.region)
            self.lru.remove(e.region)
            del self.ends[e.region]
        if got.fresh:
            assert got.region not in self.owner and got.offset == 0
            self.owner[got.region] = tenant
            self.ends[got.region] = 0
            self.lru.append(got.region)
        assert self.owner[got.region] == tenant
        assert got.offset == self.ends[got.region]  # appended, never overlapping
        self.ends[got.region] += span
        assert self.ends[got.region] <= REGION
        self._move_to_end(got.region)
        self.pending.append((got, key))

    @precondition(lambda self: self.pending)
    @rule(which=st.integers(0, 10), ok=st.booleans(), size=st.integers(0, ALIGN))
    def finish(self, which, ok, size):
        res, key = self.pending.pop(which % len(self.pending))
        if ok:
            self.seq += 1
            size = min(size, res.span - ALIGN)
            self.index.commit(res, key, size, self.seq)
            self.written[(res.tenant, key)] = Location(res.region, res.offset, size, self.seq)
        else:
            self.index.abort(res)

    @rule(tenant=st.sampled_from(TENANTS), key=st.sampled_from(KEYS))
    def remove(self, tenant, key):
        self.index.remove(tenant, key)
        self.written.pop((tenant, key), None)

    @rule(tenant=st.sampled_from(TENANTS), key=st.sampled_from(KEYS))
    def hit(self, tenant, key):
        loc = self.index.lookup(tenant, key)
        if loc is not None:
            self.index.touch(loc.region)
            self._move_to_end(loc.region)

    @rule(tenant=st.sampled_from(TENANTS),
          asked=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, ALIGN)),
                         max_size=4))
    def held(self, tenant, asked):
        want = []
        for key, size in asked:
            loc = self.written.get((tenant, key))
            want.append(loc is not None and loc.region not in self.evicted
                        and loc.size == size)
        got = self.index.held(tenant, [k for k, _ in asked], [n for _, n in asked])
        assert (got or [False] * len(asked)) == want
        if got is None:  # none of the keys is mapped at all
            assert all(self.index.lookup(tenant, k) is None for k, _ in asked)

    @rule(tenant=st.sampled_from(TENANTS),
          quota=st.one_of(st.none(), st.integers(1, 4).map(lambda n: n * REGION)))
    def set_quota(self, tenant, quota):
        self.index.set_quota(tenant, quota)
        if quota is None:
            self.quota.pop(tenant, None)
        else:
            self.quota[tenant] = quota

    @invariant()
    def entries_match_the_model(self):
        for (tenant, key), loc in self.written.items():
            want = None if loc.region in self.evicted else loc
            assert self.index.lookup(tenant, key) == want, (tenant, key)
        for tenant in TENANTS:
            for key in KEYS:
                if (tenant, key) not in self.written:
                    assert self.index.lookup(tenant, key) is None

    @invariant()
    def bytes_add_up(self):
        self.index.check()
        assert self.index.used_bytes == sum(self.ends.values()) <= CAPACITY
        assert self.index.regions() == len(self.ends)
        assert self.index.objects() == sum(1 for loc in self.written.values()
                                           if loc.region not in self.evicted)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@settings(max_examples=80, deadline=None)
@given(scans=st.lists(st.lists(st.tuples(st.sampled_from(KEYS), st.integers(1, 30),
                                         st.integers(0, 5000)), max_size=8),
                      min_size=1, max_size=4))
def test_restore_scanned_keeps_the_newest_write_of_each_key(scans):
    """Scans of regions restored one after the other, keys repeated within a scan
    and across scans in any seq order, or all new (the bulk path): each key ends at
    its highest seq, and the value bytes are those of the kept records."""
    index = DiskIndex(CAPACITY, REGION)
    model: dict[str, tuple[int, Location]] = {}
    for region, found in enumerate(scans, start=1):
        index.restore_region("a", region, REGION)
        offsets = [i * ALIGN for i in range(len(found))]
        index.restore_scanned("a", region, [k for k, _, _ in found], offsets,
                              [n for _, _, n in found], [s for _, s, _ in found],
                              [s * 7 for _, s, _ in found])
        for (key, seq, n), off in zip(found, offsets):
            if key not in model or model[key][0] < seq:
                model[key] = (seq, Location(region, off, n, seq, seq * 7))
    for key in KEYS:
        assert index.lookup("a", key) == (model[key][1] if key in model else None)
    assert index.value_bytes("a") == sum(loc.size for _, loc in model.values())
    index.check()


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.tuples(st.sampled_from(KEYS), st.integers(1, 2**40 - 1),
                                           st.integers(0, 2**64 - 1)),
                                 min_size=1, max_size=6), min_size=1, max_size=6))
def test_a_batch_commit_enters_the_same_entries_natively(batches):
    """:meth:`DiskIndex.commit_batch` gives the same entries and value bytes whether
    its loop runs in C (``ems._native.index_commit``, where built) or in Python,
    replacing keys written before too."""
    if index_module._native_commit is None:
        pytest.skip("ems._native was not built")
    got = []
    for native in (index_module._native_commit, None):
        idx = DiskIndex(1 << 40, 1 << 30)
        seq = 1
        with mock.patch.object(index_module, "_native_commit", native):
            for batch in batches:
                keys = [k for k, _, _ in batch]
                sizes = [n for _, n, _ in batch]
                res = idx.reserve("t", ALIGN)
                assert isinstance(res, Reservation)
                idx.commit_batch(res, keys, sizes, range(seq, seq + len(batch)),
                                 [res.offset + 8 * i for i in range(len(batch))],
                                 [s for _, _, s in batch])
                seq += len(batch)
        got.append((idx.entries("t"), idx.value_bytes("t")))
    assert got[0] == got[1]
    assert got[0][1] == sum(Location.unpack(p).size for p in got[0][0].values())


def test_the_native_index_commit_refuses_before_it_changes_anything():
    fn = index_module._native_commit
    if fn is None:
        pytest.skip("ems._native was not built")
    entries: dict[str, int] = {}
    for args, error in [((entries, [b"k"], [1], 1, [0], [0], 0), TypeError),
                        ((entries, ["a", "k"], [1, 2**40], 1, [0, 0], [0, 0], 0), ValueError),
                        ((entries, ["a", "k"], [1, 1], 1, [0, 2**40], [0, 0], 0), ValueError),
                        ((entries, ["a"], [1], 2**48, [0], [0], 0), ValueError),
                        ((entries, ["a"], [1, 2], 1, [0], [0], 0), ValueError),
                        ((entries, ["a"], [1], 1, [0], [-1], 0), OverflowError)]:
        with pytest.raises(error):
            fn(*args)
        assert entries == {}
