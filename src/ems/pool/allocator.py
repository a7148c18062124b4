"""Byte-range allocator over one arena.

Free extents are kept twice: by their bounds (``start -> size`` and ``end -> start``)
so that a freed extent merges with its neighbours in O(1), and in power-of-two size
buckets so that an allocation finds a fitting extent after looking at a bounded
number of candidates (first fit within the smallest bucket that can hold the size,
else any extent of a larger bucket). All sizes and offsets are multiples of
``alignment`` (64 bytes by default: a cache line, and a multiple of every dtype's
size, so the client can view pool memory as int64 rows).

V1 objects of one layout all have the same size, so their frees leave holes that the
next object of that size fits exactly; V0 values vary, and merging keeps the arena
from fragmenting into unusably small pieces. When no free extent fits, the pool
(``ems.pool.core``) frees a *window*: a run of adjacent extents it may evict, found
with :meth:`free_at`, :meth:`free_ending_at` and :meth:`extents`, and takes it with
:meth:`alloc_at`.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["Allocator"]

_SCAN = 8  # candidates examined in the exact-size bucket before moving up


class Allocator:
    """Allocate and free aligned byte ranges of ``[0, capacity_bytes)``."""

    def __init__(self, capacity_bytes: int, alignment: int = 64) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.alignment = alignment
        self.capacity_bytes = capacity_bytes - capacity_bytes % alignment
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._buckets: list[dict[int, None]] = [dict() for _ in range(64)]
        #: bit b set <=> bucket b holds a free extent: the search for a larger bucket
        #: is a bit trick instead of a scan of up to 64 buckets (it was ~1 us of the
        #: ~3 us an allocation took on a pool with free space)
        self._nonempty = 0
        self._allocated: dict[int, int] = {}
        self.used_bytes = 0
        if self.capacity_bytes > 0:
            self._add_free(0, self.capacity_bytes)

    # ---------------------------------------------------------------- internals
    def _add_free(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        b = size.bit_length() - 1
        self._buckets[b][start] = None
        self._nonempty |= 1 << b

    def _remove_free(self, start: int) -> int:
        size = self._by_start.pop(start)
        del self._by_end[start + size]
        b = size.bit_length() - 1
        bucket = self._buckets[b]
        del bucket[start]
        if not bucket:
            self._nonempty &= ~(1 << b)
        return size

    def round_up(self, size: int) -> int:
        """The number of bytes an allocation of ``size`` really takes."""
        a = self.alignment
        need = -(-size // a) * a
        return need if need > a else a

    # ---------------------------------------------------------------- public
    def alloc(self, size: int) -> Optional[int]:
        """Return the offset of ``size`` free bytes, or None when no extent fits."""
        return self.alloc_rounded(self.round_up(size))

    def alloc_rounded(self, need: int) -> Optional[int]:
        """:meth:`alloc` of a size already rounded up (:meth:`round_up`)."""
        first = need.bit_length() - 1
        start = None
        nonempty = self._nonempty
        if nonempty >> first & 1:
            for i, candidate in enumerate(self._buckets[first]):
                if self._by_start[candidate] >= need:
                    start = candidate
                    break
                if i >= _SCAN:
                    break
        if start is None:
            higher = nonempty >> (first + 1)
            if higher:  # the lowest non-empty bucket above: any of its extents fits
                b = first + (higher & -higher).bit_length()
                start = next(iter(self._buckets[b]))
        if start is None and len(self._buckets[first]) > _SCAN:
            # Rare: only extents of this bucket are left; look at all of them before
            # answering "no room" (which would make the pool evict).
            start = next((c for c in self._buckets[first] if self._by_start[c] >= need), None)
        if start is None:
            return None
        size_free = self._remove_free(start)
        if size_free > need:
            self._add_free(start + need, size_free - need)
        self._allocated[start] = need
        self.used_bytes += need
        return start

    def fits(self, need: int) -> bool:
        """Whether :meth:`alloc_rounded` of ``need`` would find a free extent (no change)."""
        first = need.bit_length() - 1
        if self._nonempty >> (first + 1):
            return True
        by_start = self._by_start
        return any(by_start[c] >= need for c in self._buckets[first])

    def alloc_at(self, start: int, need: int) -> None:
        """Allocate ``[start, start + need)`` from the free extent that starts at
        ``start`` (the pool frees a window there first); ValueError when there is no
        such extent or it is smaller."""
        size_free = self._by_start.get(start, 0)
        if size_free < need:
            raise ValueError(f"no free extent of {need} bytes at {start}")
        self._remove_free(start)
        if size_free > need:
            self._add_free(start + need, size_free - need)
        self._allocated[start] = need
        self.used_bytes += need

    def free_at(self, start: int) -> int:
        """Size of the free extent that starts at ``start`` (0: none does)."""
        return self._by_start.get(start, 0)

    def free_ending_at(self, end: int) -> Optional[int]:
        """Start of the free extent that ends at ``end``, or None."""
        return self._by_end.get(end)

    def extents(self) -> list[tuple[int, int, bool]]:
        """Every extent as ``(start, size, is_free)`` in address order (O(n log n): for
        the pool's rare search of the whole arena)."""
        return sorted([(s, n, True) for s, n in self._by_start.items()]
                      + [(s, n, False) for s, n in self._allocated.items()])

    def free(self, offset: int) -> None:
        """Give back the extent that :meth:`alloc` returned at ``offset``."""
        size = self._allocated.pop(offset)
        self.used_bytes -= size
        start, end = offset, offset + size
        if end in self._by_start:  # merge with the next free extent
            size += self._remove_free(end)
        prev = self._by_end.get(start)
        if prev is not None:  # merge with the previous free extent
            size += self._remove_free(prev)
            start = prev
        self._add_free(start, size)

    def split(self, offset: int, at: int) -> None:
        """Cut the allocated extent at ``offset`` in two at ``at``: ``[offset, at)`` and
        ``[at, end)`` are then separate allocations, each freed (and merged) on its own.

        The daemon carves a connection's lease (one extent) into objects this way.
        """
        size = self._allocated[offset]
        if not offset < at < offset + size or at % self.alignment:
            raise ValueError(f"cannot split [{offset}, +{size}) at {at}")
        self._allocated[offset] = at - offset
        self._allocated[at] = offset + size - at

    def size_of(self, offset: int) -> int:
        return self._allocated[offset]

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def largest_free(self) -> int:
        for bucket in reversed(self._buckets):
            if bucket:
                return max(self._by_start[s] for s in bucket)
        return 0

    def check(self) -> None:
        """Verify the invariants (tests call this): extents tile the arena exactly."""
        spans = sorted([(s, n, "free") for s, n in self._by_start.items()]
                       + [(s, n, "used") for s, n in self._allocated.items()])
        pos = 0
        prev_kind = None
        for start, size, kind in spans:
            assert start == pos, f"gap or overlap at {pos}: next extent starts at {start}"
            assert size > 0 and start % self.alignment == 0
            assert not (kind == "free" and prev_kind == "free"), f"unmerged free at {start}"
            pos += size
            prev_kind = kind
        assert pos == self.capacity_bytes, (pos, self.capacity_bytes)
        assert self.used_bytes == sum(self._allocated.values())
        assert self._nonempty == sum(1 << b for b, bucket in enumerate(self._buckets)
                                     if bucket)
