"""V1 CUDA caches: a request's blocks gathered on the GPU into staging, then one copy per
contiguous pool run, on a side stream ordered by events against the engine's stream.

Why staging: a paged cache's unit is small (a block of one layer's K or V: 32 KiB for
8 KV heads x 128 x fp16 x 16 tokens) and scattered over 64 tensors; a DMA per such run
runs far below the link (vLLM's OffloadingConnector and LMCache both gather on the GPU
first), and the old path -- per tensor a gather, a synchronous ``.to()`` and a CPU
scatter, then a device-wide synchronize -- blocked on every tensor. Here the GPU packs
each pool object (a block's rows of every layer, in the object's own layout) into a
device buffer, and the copies between that buffer and pool memory are as long as the
pool allows: one per run of objects that are adjacent in the pool, split only where a
registration chunk ends (:func:`cut`).

The plan (:func:`plan_stages`) is pure: objects sorted by pool offset, packed into
chunks of at most the staging capacity, with their staging offsets and runs. The
executor (:func:`move`) runs one chunk after another on a :class:`Lane` (a side
stream and its staging buffer, one per device and direction, reused)::

    side stream: wait(engine mark) -> [gather | H2D runs] -> [D2H runs | scatter]
                 -> record(e_k) -> ... next chunk ...
    host:        checkpoint before each chunk; at most 2 chunks in flight (waits e_{k-2});
                 synchronize(e_last) before returning, whatever happened
    load only:   engine stream waits on e_last

One buffer suffices: chunks are ordered on one stream, so chunk k+1's gather cannot
overwrite the buffer before chunk k's copies read it, and the host queues ahead
without waiting. A deadline is checked before each chunk; a request past it queues
nothing more and waits for what it queued (at most two chunks), so no copy is in
flight into the caller's cache, or into pool memory whose reservation is about to be
given back, after the call returns.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, Sequence

from ems.client import cuda
from ems.client.segment import window
from ems.futures import Task

__all__ = ["Lane", "StageChunk", "StageRun", "cut", "lane", "move", "plan_stages"]

#: staging offsets of separate runs are aligned like pool offsets
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class StageRun:
    """``nbytes`` between pool offset ``pool_offset`` and staging ``stage_offset``."""

    pool_offset: int
    stage_offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class StageChunk:
    """Objects staged together: request indices, their staging offsets, the copies."""

    objects: tuple[int, ...]
    stage_offsets: tuple[int, ...]
    runs: tuple[StageRun, ...]
    nbytes: int  # staging bytes the chunk spans


def cut(offset: int, nbytes: int, boundary: int) -> list[int]:
    """Lengths of the pieces of ``[offset, +nbytes)`` split at multiples of
    ``boundary`` (0: no split)."""
    if boundary <= 0 or nbytes <= 0:
        return [nbytes] if nbytes > 0 else []
    out = []
    while nbytes > 0:
        n = min(nbytes, boundary - offset % boundary)
        out.append(n)
        offset += n
        nbytes -= n
    return out


def plan_stages(objects: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
                capacity: int, boundary: int) -> list[StageChunk]:
    """Chunks for objects ``objects[i]`` at pool ``offsets[i]`` of ``sizes[i]`` bytes.

    Objects go in pool order; one that starts where the previous ended continues its
    run (and sits right after it in staging), others start a new run at an aligned
    staging offset; a chunk closes before it would pass ``capacity`` (which must hold
    the largest object). Runs are then cut at registration ``boundary``."""
    order = sorted(range(len(objects)), key=lambda k: offsets[k])
    chunks: list[StageChunk] = []
    objs: list[int] = []
    stage: list[int] = []
    runs: list[list[int]] = []  # [pool_offset, stage_offset, nbytes]
    end = 0  # staging bytes used
    pool_end = -1

    def close() -> None:
        pieces = []
        for pool_off, stage_off, n in runs:
            for length in cut(pool_off, n, boundary):
                pieces.append(StageRun(pool_off, stage_off, length))
                pool_off += length
                stage_off += length
        chunks.append(StageChunk(tuple(objs), tuple(stage), tuple(pieces), end))

    for k in order:
        size, off = sizes[k], offsets[k]
        if size > capacity:
            raise ValueError(f"an object of {size} bytes does not fit staging of {capacity}")
        joined = off == pool_end and end + size <= capacity
        start = end if joined else -(-end // _ALIGN) * _ALIGN
        if not joined and start + size > capacity and objs:
            close()
            objs, stage, runs, start = [], [], [], 0
        if joined:
            runs[-1][2] += size
        else:
            runs.append([off, start, size])
        objs.append(objects[k])
        stage.append(start)
        end = start + size
        pool_end = off + size
    if objs:
        close()
    return chunks


class Lane:
    """One direction of copies on one device: a side stream, its staging buffer (grown
    to the largest object a layout needs, never shrunk), and a lock held by the request
    that uses it (the link is the bottleneck: requests take turns)."""

    def __init__(self, ops: cuda.DeviceOps, device: Any, capacity: int) -> None:
        self.ops = ops
        self.device = device
        self.stream = ops.new_stream(device)
        self.capacity = capacity
        self.buffer = ops.staging(device, capacity)
        self.lock = threading.Lock()
        self._windows: dict[tuple[Any, int], Any] = {}

    def ensure(self, capacity: int) -> None:
        """Hold at least ``capacity`` bytes (under :attr:`lock`)."""
        if capacity > self.capacity:
            self.ops.synchronize(self.ops.record(self.stream))  # (the old one is idle)
            self.buffer = self.ops.staging(self.device, capacity)
            self.capacity = capacity
            self._windows.clear()

    def window(self, dtype: Any, width: int) -> Any:
        key = (dtype, width)
        view = self._windows.get(key)
        if view is None:
            view = self._windows[key] = window(self.buffer, dtype, width)
        return view


_lanes: dict[tuple[Any, str, bool], Lane] = {}
_lanes_lock = threading.Lock()


def lane(ops: cuda.DeviceOps, device: Any, save: bool) -> Lane:
    """The lane of ``device`` for saves or loads (made on first use)."""
    key = (id(ops), str(device), save)
    found = _lanes.get(key)
    if found is None or found.ops is not ops:  # (an id reused by another ops object)
        with _lanes_lock:
            found = _lanes.get(key)
            if found is None or found.ops is not ops:
                found = _lanes[key] = Lane(ops, device, cuda.settings().staging_bytes)
    return found


def move(lane: Lane, pool: Any, chunks: Sequence[StageChunk], task: Task,
         mark: cuda.EngineMark, save: bool,
         fill: Callable[[StageChunk, Lane], None]) -> None:
    """Run ``chunks`` on ``lane`` (see the module doc). ``pool``: the segment as a 1-D
    uint8 host tensor; ``fill(chunk, lane)`` queues the chunk's gather (save: cache ->
    staging) or scatter (load: staging -> cache) on the lane's stream."""
    ops, buf = lane.ops, lane.buffer
    in_flight: collections.deque[Any] = collections.deque()
    last = None
    with ops.translate():
        try:
            ops.wait(lane.stream, mark.event)  # after the engine's writes (or reads)
            for chunk in chunks:
                task.checkpoint()
                while len(in_flight) >= 2:
                    ops.synchronize(in_flight.popleft())
                with ops.on(lane.stream):
                    if save:
                        fill(chunk, lane)
                    for r in chunk.runs:
                        p = pool[r.pool_offset:r.pool_offset + r.nbytes]
                        s = buf[r.stage_offset:r.stage_offset + r.nbytes]
                        if save:
                            ops.copy(p, s)
                        else:
                            ops.copy(s, p)
                    if not save:
                        fill(chunk, lane)
                last = ops.record(lane.stream)
                in_flight.append(last)
        finally:
            if last is not None:  # nothing of ours is in flight once we return
                ops.synchronize(last)
        if not save and last is not None:
            ops.wait(mark.stream, last)
