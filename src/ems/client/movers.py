"""Movers copy the items of one request between the caller's memory and the pool.

A mover has two methods, called by the executor with the request's items that have
pool space (``items``: indices into the request; ``locs``: ``(segment, offset)`` of
each) and the request's :class:`~ems.futures.Task`, whose ``checkpoint()`` it calls
between copy steps so a timed-out request stops writing at once:

* ``to_pool(items, locs, task)``: save.
* ``from_pool(items, locs, task)``: load.

:class:`V0Mover` copies the caller's buffers of each key (host or device pointers);
the V1 mover (every run of a request from per-group tables, copied by the native
helper; staged batched copies for CUDA tensors) is in :mod:`ems.client.layout`.
"""

from __future__ import annotations

from typing import Sequence

from ems.client import copy as _copy
from ems.client import cuda
from ems.client.segment import Segment
from ems.client.staging import cut
from ems.futures import Task

__all__ = ["SAVE_SLICE_BYTES", "V0Mover"]

#: bytes of V0 device runs per batched CUDA call; the deadline is checked between
#: calls (~1.3 ms apart at the ~50 GB/s of a registered copy)
_DEVICE_BATCH = 64 << 20
#: the most bytes of adjacent host buffers copied as one run (the deadline is checked
#: before each run: ~0.5 ms apart at the ~8-10 GB/s of the test VM's copy)
_HOST_RUN_BYTES = 4 << 20


#: A V0 save through ``ems-server`` goes in slices of 16 MiB (``Request.save_slice_bytes``:
#: the next one's Reserve in flight while one is copied), which costs its copy nothing
#: per slice. Measured through ``ems-server --disk`` (1 GiB of 16 KiB values in saves of
#: 32 MiB, four alternating triples): 66-69 thousand values a second in one slice of
#: 2,048 keys, 69-72 in slices of 8 MiB, 71-76 in slices of 16; saves of 1 and 4 MiB
#: values to shared memory alone unchanged (``ems bench --quick``, two pairs). (V1's
#: mover plans and sorts a call's runs as a whole: 128 MiB V1 saves in slices of 16 MiB
#: went 5.6-5.7 -> 4.7 GB/s, so V1 slices at ``max_keys`` only.)
SAVE_SLICE_BYTES = 16 << 20


class V0Mover:
    """A key's value is the concatenation of its buffers, in order.

    Host buffers are copied by :func:`ems.client.copy.copy_bytes`, those that continue
    the last one on both sides (rows of one array into slots side by side: a batch's
    values, where the daemon reserved or pinned them in order) as one run of up to
    :data:`_HOST_RUN_BYTES`: a load of 64 MiB from a daemon's shared memory (huge
    pages, 30 alternating pairs) went 3.28 -> 3.77 GB/s at 16 KiB values, 5.89 -> 6.14
    at 256 KiB and 6.45 -> 6.53 at 1 MiB; saves 1-5 % (a call per buffer, with its
    release of the GIL, cost about 0.7 us: 2.7 ms of the 4,096-value load). Where the
    process has CUDA, each buffer is classified with ``cudaPointerGetAttributes``;
    device buffers are collected and copied by one batched runtime call per
    ``_DEVICE_BATCH`` bytes (:meth:`CudaRuntime.copy_runs`: it returns when they have
    landed, so nothing is in flight once the request ends, whatever its deadline did),
    never one synchronous ``cudaMemcpy`` per buffer. Their pool side is cut where a
    registration chunk ends (the driver refuses a range that spans registered and
    unregistered memory), and the segment is registered in the background on the
    first such copy (:mod:`ems.client.pinning`)."""

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
        rt = cuda.runtime()
        segment = locs[0][0]
        with segment.use():  # (one request's locations are in one segment)
            device_runs: list[cuda.Run] = []
            device = 0
            # Host buffers that continue the last one on both sides (a batch of rows
            # of one array into slots side by side) are copied as one run, up to
            # _HOST_RUN_BYTES: a copy is one call, with the GIL released once.
            run_dst = run_src = run_n = 0
            for i, (seg, offset) in zip(items, locs):
                addr = seg.address + offset
                for ptr, n in regions[i]:
                    on = rt.device_of(ptr) if rt is not None else None
                    if on is None:
                        dst, src = (addr, ptr) if save else (ptr, addr)
                        if (run_n and dst == run_dst + run_n and src == run_src + run_n
                                and run_n + n <= _HOST_RUN_BYTES):
                            run_n += n
                        else:
                            if run_n:
                                checkpoint()
                                copy(run_dst, run_src, run_n)
                            run_dst, run_src, run_n = dst, src, n
                    else:
                        device = on
                        pos = 0
                        for length in cut(addr - seg.address, n, seg.pinning.chunk_bytes):
                            pool, user = addr + pos, ptr + pos
                            device_runs.append(cuda.Run(pool, user, length) if save
                                               else cuda.Run(user, pool, length))
                            pos += length
                    addr += n
            if run_n:
                checkpoint()
                copy(run_dst, run_src, run_n)
            if device_runs and rt is not None:
                segment.pin(device)
                self._copy_device(rt, device, device_runs, task)

    @staticmethod
    def _copy_device(rt: cuda.CudaRuntime, device: int, runs: list[cuda.Run],
                     task: Task) -> None:
        batch: list[cuda.Run] = []
        size = 0
        for run in runs:
            batch.append(run)
            size += run.nbytes
            if size >= _DEVICE_BATCH:
                task.checkpoint()
                rt.copy_runs(device, batch)
                batch, size = [], 0
        if batch:
            task.checkpoint()
            rt.copy_runs(device, batch)
