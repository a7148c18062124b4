"""A connection's lease of pool space, as pure bookkeeping (no I/O; unit-tested
against a model in ``tests/unit/test_lease_model.py``).

The daemon hands each connection a LEASE: ``size`` bytes at ``offset`` of the
tenant's segment that only this connection may fill. A small save cuts aligned ranges
from it, copies into them, and one ``Put`` turns them into committed keys: one round
trip instead of Reserve + Commit. The daemon's Welcome says how large a lease is and
what the alignment is::

    [offset ........ cursor ............ end)
     cut (owned by saves     not handed
     until Put / Return)     out yet

    take(sizes)      cut ranges for a save from [cursor, end), or None when short
    want_fresh       a Put should ask for a fresh lease once less than half is left
                     (asked once at a time: ``asked``)
    install(o, n)    a fresh lease: the unused tail of the old one comes back to be
                     Returned; or the fresh one, when another thread renewed first
    refuse(now)      the daemon had no room: small saves take Reserve/Commit until
                     ``refused_until``

Thread-safe (one lock); the caller sends what comes back to be returned.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

__all__ = ["Lease"]

#: After the daemon had no room for a lease, small saves go the usual way this long.
RETRY_S = 1.0


class Lease:
    """See the module docstring."""

    def __init__(self, align: int, lease_size: int, max_keys: int) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.align = align
        #: the daemon's lease size (Welcome); 0: no leases, every save reserves
        self.lease_size = lease_size
        #: a save of at most this many bytes (counting alignment) and keys goes here
        self.small_save_bytes = lease_size // 4
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self.cursor = self.end = self.size = 0
        self.asked = False  # a Put that asks for a fresh lease is in flight
        self.refused_until = 0.0

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether a save of ``sizes`` is small enough for the lease (at most a quarter
        of one, counting each value's alignment, and one Put of keys)."""
        return (0 < len(sizes) <= self.max_keys
                and sum(sizes) + self.align * len(sizes) <= self.small_save_bytes)

    def take(self, sizes: Sequence[int], want: bool = True
             ) -> Optional[tuple[list[int], bool]]:
        """Offsets of aligned ranges for ``sizes`` (None when the lease is short),
        owned by the caller until it puts or returns them; and, when ``want``, whether
        its Put should ask for a fresh lease."""
        align = self.align
        with self._lock:
            offset, offsets = self.cursor, []
            for n in sizes:
                offsets.append(offset)
                offset += max(align, -(-n // align) * align)
            if offset > self.end:
                return None
            self.cursor = offset
            fresh = False
            if want and not self.asked and 2 * (self.end - self.cursor) < self.size:
                self.asked = fresh = True
            return offsets, fresh

    def asked_done(self) -> None:
        """The Put that asked for a fresh lease is answered (or failed)."""
        self.asked = False

    def install(self, offset: int, size: int) -> tuple[int, int]:
        """Use a fresh lease; the range ``(offset, size)`` to give back (size 0: none):
        the unused tail of the old lease, or the fresh one when another thread renewed
        the lease first (more than half of the current one is left)."""
        if offset % self.align or size <= 0:
            raise ValueError(f"a lease [{offset}, +{size}) not aligned to {self.align}")
        with self._lock:
            if 2 * (self.end - self.cursor) >= max(self.size, 1):
                return offset, size
            back = (self.cursor, self.end - self.cursor)
            self.cursor, self.end, self.size = offset, offset + size, size
            return back

    def refuse(self, now: float) -> None:
        """The daemon had no room for a lease (``now``: a monotonic time)."""
        self.refused_until = now + RETRY_S

    def refused(self, now: float) -> bool:
        return now < self.refused_until
