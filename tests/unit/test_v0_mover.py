"""V0Mover's host copies: buffers that continue each other on both sides are copied as
one run (at most ``_HOST_RUN_BYTES``), byte for byte what a copy per buffer gives; the
deadline is checked before every run."""

from __future__ import annotations

import contextlib
import mmap
from typing import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.client import copy as _copy
from ems.client import movers
from ems.client.movers import V0Mover
from ems.client.segment import Segment
from ems.futures import Cancelled, Task

#: per key: its buffers' sizes; per buffer: a gap before it in the caller's memory;
#: per key: a gap before it in the pool
_keys = st.lists(st.tuples(st.lists(st.tuples(st.integers(1, 3000), st.sampled_from([0, 0, 8])),
                                    min_size=1, max_size=3),
                           st.sampled_from([0, 0, 64])),
                 min_size=1, max_size=12)


@contextlib.contextmanager
def _counted_copies() -> Iterator[list[int]]:
    """The sizes of the copies made meanwhile (``ems.client.copy.copy_bytes`` calls)."""
    calls: list[int] = []
    real = _copy.copy_bytes

    def counting(dst: int, src: int, n: int) -> None:
        calls.append(n)
        real(dst, src, n)
    _copy.copy_bytes = counting
    try:
        yield calls
    finally:
        _copy.copy_bytes = real


def _layout(keys: list) -> tuple[np.ndarray, list[list[tuple[int, int]]], list[int], int, int]:
    """The caller's array, each key's regions in it, each key's pool offset, and the
    runs a merging copy makes (each continues the last on both sides)."""
    user = np.zeros(64 * 1024, dtype=np.uint8)
    base = user.ctypes.data
    regions, offsets = [], []
    at = pool_at = 0
    runs = 0
    last_user = last_pool = -1
    for bufs, pool_gap in keys:
        pool_at += pool_gap
        offsets.append(pool_at)
        key_regions = []
        for n, gap in bufs:
            at += gap
            if not (at == last_user and pool_at == last_pool):
                runs += 1
            key_regions.append((base + at, n))
            at += n
            pool_at += n
            last_user, last_pool = at, pool_at
        regions.append(key_regions)
    return user, regions, offsets, pool_at, runs


@settings(max_examples=60, deadline=None)
@given(_keys)
def test_adjacent_buffers_are_one_copy_and_the_bytes_are_a_copy_per_buffer(keys: list) -> None:
    user, regions, offsets, pool_bytes, runs = _layout(keys)
    user[:] = np.random.default_rng(len(keys)).integers(0, 256, user.shape, dtype=np.uint8)
    mm = mmap.mmap(-1, max(4096, pool_bytes))
    seg = Segment(7, mm)
    try:
        with _counted_copies() as calls:
            mover = V0Mover(regions)
            items = range(len(keys))
            mover.to_pool(items, [(seg, off) for off in offsets], Task(0, "save"))
            assert len(calls) == runs
            saved = np.frombuffer(mm, dtype=np.uint8)
            for key_regions, off in zip(regions, offsets):
                for addr, n in key_regions:
                    at = addr - user.ctypes.data
                    assert np.array_equal(saved[off:off + n], user[at:at + n])
                    off += n
            del saved
            back = user.copy()
            user[:] = 0
            calls.clear()
            mover.from_pool(items, [(seg, off) for off in offsets], Task(0, "load"))
            assert len(calls) == runs
            for key_regions in regions:
                for addr, n in key_regions:
                    at = addr - user.ctypes.data
                    assert np.array_equal(user[at:at + n], back[at:at + n])
    finally:
        seg.close()


def test_a_run_stops_at_its_bound_and_the_deadline_is_checked_before_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(movers, "_HOST_RUN_BYTES", 8192)
    user = np.arange(6 * 4096, dtype=np.uint32).view(np.uint8)[:6 * 4096].copy()
    regions = [[(user.ctypes.data + i * 4096, 4096)] for i in range(6)]
    seg = Segment(3, mmap.mmap(-1, 6 * 4096))
    try:
        with _counted_copies() as calls:
            V0Mover(regions).to_pool(range(6), [(seg, i * 4096) for i in range(6)],
                                     Task(0, "save"))
            assert calls == [8192, 8192, 8192]  # six adjacent pages: three runs of two
            expired = Task(1, "save")
            expired.deadline = 0.0  # (long past)
            calls.clear()
            with pytest.raises(Cancelled):
                V0Mover(regions).to_pool(range(6), [(seg, i * 4096) for i in range(6)],
                                         expired)
            assert calls == []  # nothing copied once the deadline has passed
    finally:
        seg.close()
