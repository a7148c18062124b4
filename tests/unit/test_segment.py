"""A segment's copies in flight, counted without a lock (``ems.client.segment``).

``retire`` unmaps only when no copy uses the mapping; a copy that starts after it
backs out with EMS_IO_ERROR before touching the memory; the last copy of a retired
segment unmaps it. The stress test writes into the mapping from several threads
while it is retired: a write after the unmap would crash the test process.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import pytest

from ems import EmsErrorCode, EmsException
from ems.client.segment import Segment


def segment(size: int = 1 << 16) -> Segment:
    return Segment(1, mmap.mmap(-1, size))


def test_retire_unmaps_at_once_when_no_copy_runs():
    seg = segment()
    seg.retire()
    assert not seg.mapped
    with pytest.raises(EmsException) as err, seg.use():
        pass
    assert err.value.status_code() is EmsErrorCode.EMS_IO_ERROR


def test_the_last_copy_of_a_retired_segment_unmaps_it():
    seg = segment()
    with seg.use():
        with seg.use():
            seg.retire()
            assert seg.mapped
            ctypes.memset(seg.address, 7, 4096)  # still ours
        assert seg.mapped
    assert not seg.mapped
    seg.retire()  # twice: nothing more
    seg.close()
    assert not seg.mapped


def test_copies_from_several_threads_while_it_is_retired():
    seg = segment()
    started = threading.Barrier(5)
    outcomes: list[tuple[int, int]] = []

    def copier() -> None:
        done = refused = 0
        started.wait()
        for _ in range(1_000_000):  # (bounded: the retire comes within ms)
            try:
                with seg.use() as s:
                    ctypes.memset(s.address, 1, 4096)
                done += 1
            except EmsException as exc:
                assert exc.status_code() is EmsErrorCode.EMS_IO_ERROR
                refused += 1
                break  # retired: every later use is refused too
        outcomes.append((done, refused))

    threads = [threading.Thread(target=copier) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    seg.retire()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 4 and all(refused == 1 for _, refused in outcomes)
    assert not seg.mapped and seg._users == []
