"""Movers copy the items of one request between the caller's memory and the pool.

A mover has two methods, called by the executor with the request's items that have
pool space (``items``: indices into the request; ``locs``: ``(segment, offset)`` of
each) and the request's :class:`~ems.futures.Task`, whose ``checkpoint()`` it calls
between copy steps so a timed-out request stops writing at once:

* ``to_pool(items, locs, task)``: save.
* ``from_pool(items, locs, task)``: load.

:class:`V0Mover` copies the caller's buffers of each key (host or device pointers);
the V1 mover (every run of a request from per-group tables, copied by the native
helper; torch gather/scatter for device tensors) is in :mod:`ems.client.layout`.
"""

from __future__ import annotations

from typing import Sequence

from ems.client import copy as _copy
from ems.client.segment import Segment
from ems.futures import Task

__all__ = ["V0Mover"]


class V0Mover:
    """A key's value is the concatenation of its buffers, in order."""

    def __init__(self, regions: list[list[tuple[int, int]]]) -> None:
        self.regions = regions

    def to_pool(self, items: Sequence[int], locs: Sequence[tuple[Segment, int]],
                task: Task) -> None:
        self._move(items, locs, task, True)

    def from_pool(self, items: Sequence[int], locs: Sequence[tuple[Segment, int]],
                  task: Task) -> None:
        self._move(items, locs, task, False)

    def _move(self, items: Sequence[int], locs: Sequence[tuple[Segment, int]], task: Task,
              save: bool) -> None:
        if not locs:
            return
        copy, checkpoint, regions = _copy.copy_bytes, task.checkpoint, self.regions
        with locs[0][0].use():  # (one request's locations are in one segment)
            for i, (seg, offset) in zip(items, locs):
                addr = seg.address + offset
                for ptr, n in regions[i]:
                    checkpoint()
                    if save:
                        copy(addr, ptr, n)
                    else:
                        copy(ptr, addr, n)
                    addr += n
