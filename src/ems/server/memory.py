"""The tenants' shared memory as the daemon's tiers see it: their memfds mapped once.

The daemon's loop never maps a tenant's memory (the pool core only does bookkeeping);
a tier that moves bytes between shared memory and elsewhere (a socket, a file) maps
the tenant's memfd here, once, MAP_SHARED, and slices views of it for its workers.

A tenant the control plane deletes is let go (:meth:`SegmentMaps.forget`): its mapping
goes as soon as the last view of it is released, so its memory goes back to the system
with the tenant, not when the daemon stops (a mapping keeps a memfd's pages alive after
its descriptor is closed). No view of it is made after that: its descriptor is closed
next, and its number may soon name another file.
"""

from __future__ import annotations

import mmap
import threading

from ems.server.tenants import Tenant

__all__ = ["SegmentGone", "SegmentMaps"]


class SegmentGone(Exception):
    """The tenant's memory was let go (the tenant was deleted): there is no view of it."""


class SegmentMaps:
    """Each tenant's memory, mapped on first use (thread-safe)."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        #: the segment ids let go (:meth:`forget`): never mapped again
        self._gone: set[int] = set()
        self._lock = threading.Lock()

    def view(self, tenant: Tenant, offset: int, size: int) -> memoryview:
        """``size`` bytes of ``tenant``'s memory at ``offset`` (release it when done).

        Keyed by the segment's random id, never by ``id(tenant)``: a tenant removed by
        the control plane and a new one at the same address must not share a mapping.
        :class:`SegmentGone` once the tenant was let go (:meth:`forget`).
        """
        entry = self._maps.get(tenant.segment_id)
        if entry is None:
            with self._lock:
                entry = self._maps.get(tenant.segment_id)
                if entry is None:
                    if tenant.segment_id in self._gone:
                        raise SegmentGone(f"tenant {tenant.name!r} was deleted")
                    mm = mmap.mmap(tenant.fd, tenant.segment_size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    entry = self._maps[tenant.segment_id] = (mm, memoryview(mm))
        return entry[1][offset:offset + size]

    def forget(self, tenant: Tenant) -> None:
        """Let go of ``tenant``'s memory (deleted; before its descriptor is closed): no
        view of it from now on, and its mapping goes now, or when the last view made
        before is released (a write or read in flight) and Python frees the map."""
        with self._lock:  # (after a mapping being made of it: then its fd is still open)
            self._gone.add(tenant.segment_id)
            entry = self._maps.pop(tenant.segment_id, None)
        if entry is not None:
            mm, view = entry
            view.release()
            try:
                mm.close()
            except BufferError:  # views still out: unmapped when the last is released
                pass

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
