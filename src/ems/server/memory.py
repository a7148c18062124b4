"""The tenants' shared memory as the daemon's tiers see it: their memfds mapped once.

The daemon's loop never maps a tenant's memory (the pool core only does bookkeeping);
a tier that moves bytes between shared memory and elsewhere (a socket, a file) maps
the tenant's memfd here, once, MAP_SHARED, and slices views of it for its workers.
"""

from __future__ import annotations

import mmap
import threading

from ems.server.tenants import Tenant

__all__ = ["SegmentMaps"]


class SegmentMaps:
    """Each tenant's memory, mapped on first use (thread-safe)."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self._lock = threading.Lock()

    def view(self, tenant: Tenant, offset: int, size: int) -> memoryview:
        """``size`` bytes of ``tenant``'s memory at ``offset`` (release it when done).

        Keyed by the segment's random id, never by ``id(tenant)``: a tenant removed by
        the control plane and a new one at the same address must not share a mapping.
        """
        entry = self._maps.get(tenant.segment_id)
        if entry is None:
            with self._lock:
                entry = self._maps.get(tenant.segment_id)
                if entry is None:
                    mm = mmap.mmap(tenant.fd, tenant.segment_size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    entry = self._maps[tenant.segment_id] = (mm, memoryview(mm))
        return entry[1][offset:offset + size]

    def close(self) -> None:
        """Unmap everything (after every view was released)."""
        with self._lock:
            for mm, view in self._maps.values():
                view.release()
                try:
                    mm.close()
                except BufferError:  # a view still exported (a bug elsewhere): leave it
                    pass
            self._maps.clear()
