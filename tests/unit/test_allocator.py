"""The byte-range allocator: alignment, merging, fragmentation, exhaustion, and the
invariant check itself."""

from __future__ import annotations

import random

import pytest

from ems.pool import Allocator


def test_alloc_rounds_up_to_the_alignment():
    a = Allocator(4096, alignment=64)
    assert a.round_up(1) == 64 and a.round_up(64) == 64 and a.round_up(65) == 128
    assert a.round_up(0) == 64
    off = a.alloc(1)
    assert off == 0 and a.size_of(off) == 64 and a.used_bytes == 64
    off2 = a.alloc(100)
    assert off2 % 64 == 0 and a.size_of(off2) == 128
    a.check()


def test_capacity_is_rounded_down_to_the_alignment():
    a = Allocator(1000, alignment=64)
    assert a.capacity_bytes == 960 and a.free_bytes == 960
    a.check()


@pytest.mark.parametrize("alignment", [0, -64, 3, 96])
def test_alignment_must_be_a_power_of_two(alignment):
    with pytest.raises(ValueError):
        Allocator(4096, alignment=alignment)


def test_free_merges_with_both_neighbours():
    a = Allocator(64 * 8)
    offs = [a.alloc(64) for _ in range(8)]
    assert offs == [64 * i for i in range(8)]
    assert a.alloc(1) is None and a.free_bytes == 0
    a.free(offs[2])
    a.free(offs[4])
    a.check()
    assert a.largest_free() == 64
    a.free(offs[3])  # merges [2], [3], [4] into one extent
    a.check()
    assert a.largest_free() == 192
    assert a.alloc(192) == offs[2]
    a.check()


def test_free_everything_gives_one_extent_back():
    a = Allocator(1 << 16)
    offs = [a.alloc(n) for n in (64, 200, 1000, 64, 5000, 128)]
    for off in reversed(offs[::2]):
        a.free(off)
    for off in offs[1::2]:
        a.free(off)
    a.check()
    assert a.used_bytes == 0 and a.largest_free() == a.capacity_bytes


def test_fragmentation_fails_a_large_alloc_until_holes_merge():
    a = Allocator(64 * 16)
    offs = [a.alloc(64) for _ in range(16)]
    for off in offs[::2]:  # free every other block: half the pool free, in 64 B holes
        a.free(off)
    a.check()
    assert a.free_bytes == 64 * 8 and a.largest_free() == 64
    assert a.alloc(128) is None
    assert a.alloc(64) is not None  # a hole still fits an exact-size object
    a.free(offs[1])  # frees the block between two holes: 3 blocks merge
    a.check()
    assert a.alloc(128) is not None


def test_exhaustion_and_oversize():
    a = Allocator(4096)
    assert a.alloc(8192) is None
    assert a.alloc(4096) == 0
    assert a.alloc(1) is None
    a.free(0)
    assert a.alloc(4096) == 0


def test_zero_capacity():
    a = Allocator(32, alignment=64)
    assert a.capacity_bytes == 0 and a.alloc(1) is None
    a.check()


def test_double_free_is_an_error():
    a = Allocator(4096)
    off = a.alloc(64)
    a.free(off)
    with pytest.raises(KeyError):
        a.free(off)
    a.check()


def test_check_detects_broken_invariants():
    a = Allocator(4096)
    a.alloc(64)
    a.used_bytes += 64  # corrupt the accounting
    with pytest.raises(AssertionError):
        a.check()


def test_random_alloc_free_keeps_the_invariants():
    rnd = random.Random(7)
    a = Allocator(1 << 16)
    live: dict[int, int] = {}
    for step in range(2000):
        if live and rnd.random() < 0.45:
            off = rnd.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rnd.choice([1, 64, 100, 512, 777, 4096, 10000])
            off = a.alloc(size)
            if off is not None:
                assert off not in live
                live[off] = a.size_of(off)
                assert a.size_of(off) >= size
        if step % 50 == 0:
            a.check()
            spans = sorted(live.items())
            assert all(s + n <= t for (s, n), (t, _) in zip(spans, spans[1:]))
    a.check()
    assert a.used_bytes == sum(live.values()) <= a.capacity_bytes


def test_split_makes_two_allocations_that_free_and_merge_on_their_own():
    a = Allocator(64 * 8)
    off = a.alloc(64 * 6)
    a.split(off, 64 * 2)
    a.split(64 * 2, 64 * 5)
    assert [a.size_of(o) for o in (0, 128, 320)] == [128, 192, 64]
    assert a.used_bytes == 64 * 6
    a.check()
    a.free(128)  # the middle one: free between two allocations
    a.check()
    assert a.free_bytes == 64 * 5 and a.largest_free() == 64 * 3
    a.free(320)  # merges with the middle hole and the arena's free tail
    a.check()
    assert a.largest_free() == 64 * 6
    a.free(0)
    a.check()
    assert a.free_bytes == a.capacity_bytes and a.largest_free() == a.capacity_bytes


@pytest.mark.parametrize("at", [0, 64 * 4, 32, 64 * 5])
def test_split_only_inside_an_allocation_at_the_alignment(at):
    a = Allocator(64 * 8)
    off = a.alloc(64 * 4)
    with pytest.raises(ValueError):
        a.split(off, at)
    with pytest.raises(KeyError):
        a.split(64, 128)  # not the start of an allocation
    a.check()
