"""Pool memory registered with CUDA (page-locked), once per segment, off the critical path.

A copy between a GPU and pageable host memory goes through the driver's own pinned
bounce buffer, a chunk at a time, and blocks the calling thread: measured elsewhere
at 9.6 GB/s against 32.4 GB/s from registered memory (and vLLM reports ~50 GB/s one
way on H100 at 2 MB blocks from its registered mmap). So each segment this process
maps (a daemon's memfd, the embedded pool's arena) is registered with
``cudaHostRegister`` (portable), but

* only once this process moves device memory through it (the first V0 device pointer
  or V1 CUDA tensor): registering creates a CUDA context on the thread's device, which
  a scheduler process that holds no KV must not pay (hundreds of MiB of GPU memory);
* in chunks of ``register_chunk_bytes`` (:func:`plan_chunks`), on a background thread:
  registration runs at 1-2 GB/s (pinning every page), seconds for a large pool, and a
  request must not wait for it. Copies meanwhile use the pageable path; a copy is
  split at chunk boundaries (:func:`ems.client.staging.split_runs`), because the
  driver refuses one range that spans registered and unregistered memory;
* with a pageable fallback where the driver refuses (no ``IPC_LOCK`` in a container,
  a memlock limit, a device without it): logged once per process, counted, and the
  segment's copies keep working, slower;
* unregistered before the memory is unmapped (:meth:`Segment.close` calls
  :meth:`Pinning.release` first), also when a daemon restart retires a segment.

Only memory the segment owns is registered: never a caller's buffer or tensor.

States of one segment's registration::

    IDLE --start(device)--> REGISTERING --every chunk done--> REGISTERED
                                 |   \\--driver refused-----> REFUSED (pageable)
                                 |                               |
    (any state) --release(): stop after the current chunk, unregister the chunks
                  registered so far--> RELEASED
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
from typing import Optional

from ems.client import cuda
from ems.errors import EmsException

__all__ = ["Chunk", "Pinning", "PinningStatistics", "PinState", "plan_chunks",
           "statistics"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``nbytes`` from ``offset`` of the segment: one ``cudaHostRegister`` call."""

    offset: int
    nbytes: int


def plan_chunks(size: int, chunk_bytes: int) -> list[Chunk]:
    """The registration calls of a segment of ``size`` bytes: they cover it exactly
    once, in order, each ``chunk_bytes`` but the last."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be > 0")
    return [Chunk(off, min(chunk_bytes, size - off)) for off in range(0, size, chunk_bytes)]


class PinState(enum.Enum):
    IDLE = "idle"
    REGISTERING = "registering"
    REGISTERED = "registered"
    REFUSED = "refused"
    RELEASED = "released"


@dataclasses.dataclass(frozen=True)
class PinningStatistics:
    """Process totals: segments registering now, bytes registered now, chunks
    registered and unregistered since start, segments whose registration the driver
    refused (and their bytes left pageable)."""

    registering: int
    registered_bytes: int
    chunks_registered: int
    chunks_unregistered: int
    refusals: int
    pageable_bytes: int


class _Totals:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.registering = 0
        self.registered_bytes = 0
        self.chunks_registered = 0
        self.chunks_unregistered = 0
        self.refusals = 0
        self.pageable_bytes = 0
        self.warned = False


_totals = _Totals()


def statistics() -> PinningStatistics:
    t = _totals
    with t.lock:
        return PinningStatistics(t.registering, t.registered_bytes, t.chunks_registered,
                                 t.chunks_unregistered, t.refusals, t.pageable_bytes)


class Pinning:
    """The registration of one segment (``address``, ``size``): see the module doc."""

    def __init__(self, address: int, size: int, chunk_bytes: int) -> None:
        self.address = address
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.state = PinState.IDLE
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._done: list[Chunk] = []  # registered, in order
        self._device = 0
        self._pid = os.getpid()

    def start(self, device: int) -> None:
        """Begin registering for ``device`` (the first call only; cheap after)."""
        if self.state is not PinState.IDLE:
            return
        rt = cuda.runtime()
        with self._lock:
            if self.state is not PinState.IDLE or rt is None:
                return
            self.state = PinState.REGISTERING
            self._device = device
            with _totals.lock:
                _totals.registering += 1
            self._thread = threading.Thread(target=self._run, args=(rt,), daemon=True,
                                            name="ems-cuda-register")
            self._thread.start()

    def _run(self, rt: cuda.CudaRuntime) -> None:
        try:
            self._register(rt)
        finally:
            with _totals.lock:
                _totals.registering -= 1

    def _register(self, rt: cuda.CudaRuntime) -> None:
        for chunk in plan_chunks(self.size, self.chunk_bytes):
            if self._stop.is_set():
                return
            try:
                refused = rt.host_register(self._device, self.address + chunk.offset,
                                           chunk.nbytes)
            except EmsException as exc:  # (cudaSetDevice failed: treated as a refusal)
                refused = exc.message()
            with self._lock:
                if refused is None:
                    self._done.append(chunk)
                    with _totals.lock:
                        _totals.registered_bytes += chunk.nbytes
                        _totals.chunks_registered += 1
                    continue
                self.state = PinState.REFUSED
            with _totals.lock:
                _totals.refusals += 1
                _totals.pageable_bytes += self.size - chunk.offset
                first, _totals.warned = not _totals.warned, True
            (logger.warning if first else logger.debug)(
                "ems: cudaHostRegister refused pool memory (%s); copies to and from the "
                "GPU use pageable memory, slower (EMS_CUDA_REGISTER=0 skips trying)",
                refused)
            return
        with self._lock:
            if self.state is PinState.REGISTERING:
                self.state = PinState.REGISTERED

    def release(self) -> None:
        """Stop registering and unregister what was registered; call before unmapping
        (safe to call twice; in a forked child, whose parent registered, a no-op)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            done, self._done = self._done, []
            self.state = PinState.RELEASED
        if not done or os.getpid() != self._pid:
            return
        rt = cuda.runtime()
        if rt is None:
            return
        for chunk in reversed(done):
            try:
                rt.host_unregister(self._device, self.address + chunk.offset)
            except EmsException as exc:  # the memory is unmapped next: nothing to retry
                logger.warning("ems: cudaHostUnregister failed: %s", exc)
            with _totals.lock:
                _totals.registered_bytes -= chunk.nbytes
                _totals.chunks_unregistered += 1
