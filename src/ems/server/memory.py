"""The tenants' shared memory as the daemon's tiers see it: their memfds mapped once.

The daemon's loop never maps a tenant's memory (the pool core only does bookkeeping);
a tier that moves bytes between shared memory and elsewhere (a socket, a file) maps
the tenant's memfd here, once, MAP_SHARED, and slices views of it for its workers.

A tenant the control plane deletes is let go (:meth:`SegmentMaps.forget`): its mapping
goes as soon as the last view of it is released, so its memory goes back to the system
with the tenant, not when the daemon stops (a mapping keeps a memfd's pages alive after
its descriptor is closed). No view of it is made after that: its descriptor is closed
next, and its number may soon name another file.

**Populated.** A new mapping has no page tables: each 4 KiB page the tier's first pass
touches faults once, in the middle of a disk read or write (the kernel pins the pages
of an I/O one by one). A thread of its own fills them as soon as the mapping is made
(``madvise(MADV_POPULATE_WRITE)`` in chunks, without the GIL), which the driver does
for every tenant at its start: measured through ``ems-server --disk`` on a tmpfs (a
device faster than the CPU), loads of 1 MiB values after a restart ran at 1.6-2.0 GB/s
over the first pass of 256 MiB of shared memory and ~3 GB/s after; with the mapping
populated the first pass ran at ~3 GB/s too (the client maps with ``MAP_POPULATE`` for
the same reason: ``ems.client.channel``). ``MAP_POPULATE`` itself is not used here: the
``mmap`` call holds the GIL while it populates (~0.1 s per 256 MiB on the benchmark VM).
A kernel older than 5.14 refuses the advice, and the pages fault in as before.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Sequence

from ems.server.tenants import Tenant

__all__ = ["SegmentGone", "SegmentMaps"]


#: madvise(2) advice: fill a range's page tables for writing (Linux 5.14)
MADV_POPULATE_WRITE = 23
#: bytes populated per call: between calls the thread looks whether the map was let go
POPULATE_CHUNK_BYTES = 64 << 20

_madvise = ctypes.CDLL(None, use_errno=True).madvise  # (ctypes releases the GIL)
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int


class SegmentGone(Exception):
    """The tenant's memory was let go (the tenant was deleted): there is no view of it."""


class SegmentMaps:
    """Each tenant's memory, mapped on first use (thread-safe)."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        #: the segment ids let go (:meth:`forget`): never mapped again
        self._gone: set[int] = set()
        self._closed = False
        self._lock = threading.Lock()
        #: bytes whose page tables the populating threads filled (for tests)
        self.populated_bytes = 0

    def prepare(self, tenant: Tenant) -> None:
        """Map ``tenant``'s memory now, populated in the background (module doc)."""
        try:
            self._entry(tenant)
        except SegmentGone:
            pass

    def view(self, tenant: Tenant, offset: int, size: int) -> memoryview:
        """:meth:`views` of one range."""
        return self.views(tenant, (offset,), (size,))[0]

    def views(self, tenant: Tenant, offsets: Sequence[int], sizes: Sequence[int]
              ) -> list[memoryview]:
        """``sizes[i]`` bytes of ``tenant``'s memory at ``offsets[i]``, each (release
        them when done). One call a batch: a writer of a 16 KiB spill made a call per
        value, about 0.1 us of the interpreter lock each.

        Keyed by the segment's random id, never by ``id(tenant)``: a tenant removed by
        the control plane and a new one at the same address must not share a mapping.
        :class:`SegmentGone` once the tenant was let go (:meth:`forget`).
        """
        entry = self._maps.get(tenant.segment_id)
        if entry is None:
            entry = self._entry(tenant)
        whole = entry[1]
        return [whole[offset:offset + size] for offset, size in zip(offsets, sizes)]

    def _entry(self, tenant: Tenant) -> tuple[mmap.mmap, memoryview]:
        with self._lock:
            entry = self._maps.get(tenant.segment_id)
            if entry is not None:
                return entry
            if tenant.segment_id in self._gone or self._closed:
                raise SegmentGone(f"the memory of tenant {tenant.name!r} was let go")
            mm = mmap.mmap(tenant.fd, tenant.segment_size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            entry = self._maps[tenant.segment_id] = (mm, memoryview(mm))
        threading.Thread(target=self._populate, args=(tenant.segment_id, mm),
                         name="ems-populate", daemon=True).start()
        return entry

    def _populate(self, segment_id: int, mm: mmap.mmap) -> None:
        """Fill ``mm``'s page tables a chunk at a time, while it is still in use."""
        size = len(mm)
        for start in range(0, size, POPULATE_CHUNK_BYTES):
            n = min(POPULATE_CHUNK_BYTES, size - start)
            with self._lock:
                entry = self._maps.get(segment_id)
                if self._closed or entry is None or entry[0] is not mm:
                    return  # let go, or every map closed
                # (an export of the map: it is not unmapped under the call)
                chunk = (ctypes.c_char * n).from_buffer(mm, start)
            try:
                if _madvise(ctypes.addressof(chunk), n, MADV_POPULATE_WRITE) != 0:
                    return  # refused (a kernel before 5.14): pages fault in when used
            finally:
                del chunk
            with self._lock:
                self.populated_bytes += n

    def forget(self, tenant: Tenant) -> None:
        """Let go of ``tenant``'s memory (deleted; before its descriptor is closed): no
        view of it from now on, and its mapping goes now, or when the last view made
        before is released (a write or read in flight) and Python frees the map."""
        with self._lock:  # (after a mapping being made of it: then its fd is still open)
            self._gone.add(tenant.segment_id)
            entry = self._maps.pop(tenant.segment_id, None)
        if entry is not None:
            _unmap(entry)

    def close(self) -> None:
        """Unmap everything (after every view was released)."""
        with self._lock:
            self._closed = True
            for entry in self._maps.values():
                _unmap(entry)
            self._maps.clear()


def _unmap(entry: tuple[mmap.mmap, memoryview]) -> None:
    """Release a map's own view and close it; with views still out (a read or write in
    flight, or the populating thread's chunk) it is unmapped when the last is released
    and Python frees it."""
    mm, view = entry
    view.release()
    try:
        mm.close()
    except BufferError:
        pass
