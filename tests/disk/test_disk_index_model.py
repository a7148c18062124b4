"""The disk index (``ems.disk.index.DiskIndex``) against a model: a dict of what was
written last per key, the regions in least-recently-used order, and which regions were
evicted. The index must return exactly the model's location for every key whose region
is still there, nothing for the others, never evict a region with a write in flight,
evict least recently used first, and stay within the capacity and each quota."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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
