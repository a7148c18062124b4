"""The client's lease bookkeeping (``ems.client.lease.Lease``) against a model: every
byte handed out is inside a lease the daemon gave, aligned, never handed out twice,
and every byte of an old lease is either handed out or comes back to be returned."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ems.client.lease import Lease

ALIGN = 64
LEASE = 16 << 10


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lease = Lease(ALIGN, LEASE, max_keys=16)
        self.next_offset = 0  # where the daemon's next lease starts
        self.granted: list[tuple[int, int]] = []  # leases the daemon handed out
        self.taken: list[tuple[int, int]] = []  # ranges handed to saves
        self.returned: list[tuple[int, int]] = []  # ranges given back

    @rule(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6))
    def take(self, sizes):
        cut = self.lease.take(sizes)
        if cut is None:
            return
        offsets, fresh = cut
        for o, n in zip(offsets, sizes):
            assert o % ALIGN == 0
            self.taken.append((o, max(ALIGN, -(-n // ALIGN) * ALIGN)))
        if fresh:
            self.lease.asked_done()

    @rule(size=st.sampled_from([LEASE, LEASE // 2, 4096]))
    def install(self, size):
        offset = self.next_offset
        self.next_offset += size + 4 * ALIGN
        self.granted.append((offset, size))
        back = self.lease.install(offset, size)
        if back[1]:
            self.returned.append(back)

    @invariant()
    def ranges_are_disjoint_and_inside_a_lease(self):
        spans = sorted(self.taken + self.returned)
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a + n <= b, (a, n, b)
        for o, n in spans:
            assert any(g <= o and o + n <= g + s for g, s in self.granted), (o, n)

    @invariant()
    def nothing_is_lost(self):
        # every byte of a lease that is no longer current was taken or returned
        current = (self.lease.end - self.lease.size, self.lease.size)
        for g, s in self.granted:
            if (g, s) == current:
                continue
            used = sum(min(o + n, g + s) - max(o, g) for o, n in self.taken + self.returned
                       if o < g + s and g < o + n)
            assert used == s, (g, s, used)


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=150, stateful_step_count=30,
                                     deadline=None)


def test_fits_counts_alignment_and_keys():
    lease = Lease(ALIGN, LEASE, max_keys=2)
    assert lease.fits([LEASE // 4 - ALIGN])
    assert not lease.fits([LEASE // 4 - ALIGN + 1])
    assert not lease.fits([1, 1, 1])  # more keys than one Put may carry
    assert not lease.fits([])
    assert not Lease(ALIGN, 0, max_keys=2).fits([1])  # no leases from this daemon


def test_a_fresh_lease_is_asked_for_once_at_a_time():
    lease = Lease(ALIGN, LEASE, max_keys=16)
    lease.install(0, LEASE)
    _, fresh = lease.take([LEASE // 2 + 64])
    assert fresh
    assert lease.take([64]) == ([LEASE // 2 + 64], False)  # one is in flight already
    lease.asked_done()
    assert lease.take([64])[1]


def test_a_misaligned_lease_is_refused():
    with pytest.raises(ValueError):
        Lease(ALIGN, LEASE, 16).install(3, LEASE)
    with pytest.raises(ValueError):
        Lease(48, LEASE, 16)


def test_refusal_backs_off():
    lease = Lease(ALIGN, LEASE, 16)
    lease.refuse(100.0)
    assert lease.refused(100.5) and not lease.refused(101.5)
