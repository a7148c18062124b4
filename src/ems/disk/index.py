"""The disk store's bookkeeping, pure: which record holds a key, which region a write
goes to, and which regions make room when the disk or a tenant's share is full.

No file, clock, lock or thread: the store holds one lock around every call and does the
I/O. Proven against a dict model in ``tests/disk/test_index_model.py``.

Regions and eviction (CacheLib Navy's region eviction): each tenant appends its records
to its own *active* region, a file that grows up to ``region_bytes``; a record that does
not fit seals the region and opens a new one. Space is reclaimed a whole region at a
time, the least recently used first (a hit or a write moves its region to the back),
so the disk sees only large sequential writes and whole-file deletes, never a hole
punched into the middle of a file, and the index needs no free-space map. Dead records
(overwritten or deleted keys) keep their bytes until their region goes. A tenant over
its quota gives up its own least recently used region; a full disk gives up the least
recently used region of any tenant. A region with a write in flight is never taken.

A region's lifecycle::

    (new) --reserve--> active --full / evicted-->  sealed --evicted--> (gone)
                         |  writers > 0: never evicted  |

An entry is packed into one int (checksum | seq | size | offset | region), one small
object per key instead of a tuple of five: the index of a million keys is the keys'
strings plus ~60 bytes a key.

A reservation holds one write buffer's batch (``ems.disk.records``): the store commits
each of its records at its own offset inside it (:meth:`DiskIndex.commit`), and the
reservation's offset stays pending until the last one.
"""

from __future__ import annotations

import enum
import importlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

from ems.disk.records import ALIGN

__all__ = ["DiskIndex", "Evicted", "Location", "Refusal", "Reservation", "columns"]

_SUM_BITS = 64
_SEQ_BITS = 48
_SIZE_BITS = 40
_OFFSET_BITS = 40
_SEQ_AT = _SUM_BITS
_SIZE_AT = _SEQ_AT + _SEQ_BITS
_OFFSET_AT = _SIZE_AT + _SIZE_BITS
_REGION_AT = _OFFSET_AT + _OFFSET_BITS
_SUM_MASK = (1 << _SUM_BITS) - 1
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_SIZE_MASK = (1 << _SIZE_BITS) - 1
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


def _pack(region: int, offset: int, size: int, seq: int, checksum: int) -> int:
    return ((region << _REGION_AT) | (offset << _OFFSET_AT) | (size << _SIZE_AT)
            | (seq << _SEQ_AT) | checksum)


def _native_index_commit() -> Optional[Callable[..., int]]:
    """``ems._native.index_commit`` where it was built with this module's bit layout."""
    try:
        native = importlib.import_module("ems._native")
    except ImportError:  # pragma: no cover - no compiler at install
        return None
    if getattr(native, "INDEX_LAYOUT", None) != (_SEQ_AT, _SIZE_AT, _OFFSET_AT, _REGION_AT):
        return None  # pragma: no cover - a stale build
    return native.index_commit


#: :meth:`DiskIndex.commit_batch`'s loop in C (None without the native helper): a
#: writer's entries packed there, 0.58 -> 0.43 us an entry (batches of 256 into an index
#: of 131,072 keys; five big-int operations per entry in Python), on a thread that
#: shares the GIL with the daemon's loop; the same entries either way
#: (``tests/disk/test_disk_index_model.py``)
_native_commit = _native_index_commit()


def _region_of(packed: int) -> int:
    return packed >> _REGION_AT


class Location(NamedTuple):
    """Where a key's record is: region id, byte offset of its value in the region file,
    value size, the write's sequence number and the record's checksum
    (``ems.disk.records.record_checksum``: what a read checks the value against).

    A named tuple made by :meth:`unpack` through ``tuple.__new__`` (no ``__init__``):
    every key a load reads from the disk is looked up, and a frozen dataclass cost
    2.3-2.9 us a lookup on the 2-vCPU VM (``object.__setattr__`` per field), a tenth
    of the daemon's CPU per 16 KiB value loaded; this one 0.75-1.45 us."""

    region: int
    offset: int
    size: int
    seq: int
    checksum: int = 0

    @classmethod
    def unpack(cls, packed: int) -> Location:
        return _new(cls, (packed >> _REGION_AT, (packed >> _OFFSET_AT) & _OFFSET_MASK,
                          (packed >> _SIZE_AT) & _SIZE_MASK, (packed >> _SEQ_AT) & _SEQ_MASK,
                          packed & _SUM_MASK))


#: a named tuple made from a tuple of all its fields, without its ``__new__``'s call
_new = tuple.__new__


def columns(entries: dict[str, int]) -> tuple[list[str], array, array, array, array, array]:
    """A tenant's packed entries (:meth:`DiskIndex.entries`) as columns: keys, regions,
    offsets, sizes, seqs, checksums (one comprehension each: a million in ~0.5 s, where a
    :class:`Location` per entry took 3 s)."""
    packed = list(entries.values())
    return (list(entries),
            array("Q", [p >> _REGION_AT for p in packed]),
            array("Q", [(p >> _OFFSET_AT) & _OFFSET_MASK for p in packed]),
            array("Q", [(p >> _SIZE_AT) & _SIZE_MASK for p in packed]),
            array("Q", [(p >> _SEQ_AT) & _SEQ_MASK for p in packed]),
            array("Q", [p & _SUM_MASK for p in packed]))


class Refusal(enum.Enum):
    """Why :meth:`DiskIndex.reserve` found no room."""

    QUOTA = "quota"  # the tenant's share is full of regions with writes in flight
    NO_SPACE = "no_space"  # the disk is full of regions with writes in flight
    TOO_LARGE = "too_large"  # the record is larger than a region, the quota or the disk


@dataclass(frozen=True)
class Evicted:
    """A region the index gave up: the store deletes its file. ``keys``: the entries
    that went with it (the keys whose record lived there; KV events name them)."""

    tenant: str
    region: int
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reservation:
    """Room for one record: ``span`` bytes at ``offset`` of ``region``; ``fresh`` when the
    region is new (the store creates its file). ``evicted`` made the room."""

    tenant: str
    region: int
    offset: int
    span: int
    fresh: bool
    evicted: tuple[Evicted, ...]


class _Region:
    __slots__ = ("tenant", "id", "end", "pending", "keys")

    def __init__(self, tenant: str, rid: int, end: int) -> None:
        self.tenant = tenant
        self.id = rid
        self.end = end  # bytes used (reserved) in the file
        self.pending: set[int] = set()  # offsets of writes in flight
        self.keys: list[str] = []  # keys committed here (some may since live elsewhere)


class DiskIndex:
    """Keys -> records, regions in LRU order, bytes per tenant and on the disk."""

    def __init__(self, capacity_bytes: int, region_bytes: int) -> None:
        if region_bytes % ALIGN or region_bytes <= 0:
            raise ValueError(f"region_bytes must be a positive multiple of {ALIGN}")
        self.capacity_bytes = capacity_bytes
        self.region_bytes = region_bytes
        self.used_bytes = 0
        self.next_region = 1
        self._entries: dict[str, dict[str, int]] = {}
        self._regions: OrderedDict[int, _Region] = OrderedDict()  # global LRU order
        self._by_tenant: dict[str, OrderedDict[int, _Region]] = {}
        self._active: dict[str, int] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._value_bytes: dict[str, int] = {}
        self._quota: dict[str, int] = {}

    # --- queries ---------------------------------------------------------------------

    def lookup(self, tenant: str, key: str) -> Optional[Location]:
        packed = self._entries.get(tenant, {}).get(key)
        return None if packed is None else Location.unpack(packed)

    def size_of(self, tenant: str, key: str) -> Optional[int]:
        packed = self._entries.get(tenant, {}).get(key)
        return None if packed is None else (packed >> _SIZE_AT) & _SIZE_MASK

    def held(self, tenant: str, keys: Sequence[str], sizes: Sequence[int]
             ) -> Optional[list[bool]]:
        """Per key whether the index maps it to a value of its size in ``sizes``; None
        when it maps none of ``keys`` (a writer's batch of new blocks, the usual case:
        one pass at C speed, ``isdisjoint``, where a list of sizes and one of
        comparisons cost a 16 KiB spill ~0.4 us of the interpreter lock a value)."""
        entries = self._entries.get(tenant)
        if not entries or entries.keys().isdisjoint(keys):
            return None
        return [p is not None and (p >> _SIZE_AT) & _SIZE_MASK == n
                for p, n in zip(map(entries.get, keys), sizes)]

    def objects(self, tenant: Optional[str] = None) -> int:
        if tenant is not None:
            return len(self._entries.get(tenant, {}))
        return sum(len(d) for d in self._entries.values())

    def tenant_bytes(self, tenant: str) -> int:
        """Disk bytes the tenant's regions occupy (what its quota bounds)."""
        return self._tenant_bytes.get(tenant, 0)

    def value_bytes(self, tenant: str) -> int:
        """Bytes of the tenant's live values."""
        return self._value_bytes.get(tenant, 0)

    def quota(self, tenant: str) -> Optional[int]:
        return self._quota.get(tenant)

    def tenants(self) -> list[str]:
        return sorted(set(self._entries) | set(self._by_tenant) | set(self._quota))

    def regions(self) -> int:
        return len(self._regions)

    def region_tenant(self, region: int) -> Optional[str]:
        r = self._regions.get(region)
        return None if r is None else r.tenant

    def region_ids(self, tenant: str) -> list[int]:
        """The tenant's regions, least recently used first."""
        return list(self._by_tenant.get(tenant, {}))

    # --- updates ---------------------------------------------------------------------

    def set_quota(self, tenant: str, quota_bytes: Optional[int]) -> None:
        if quota_bytes is None:
            self._quota.pop(tenant, None)
        else:
            self._quota[tenant] = quota_bytes

    def touch(self, region: int) -> None:
        r = self._regions.get(region)
        if r is not None:
            self._regions.move_to_end(region)
            self._by_tenant[r.tenant].move_to_end(region)

    def reserve(self, tenant: str, span: int) -> Union[Reservation, Refusal]:
        """Room for a ``span``-byte record of ``tenant``, evicting whole regions (least
        recently used first) to make it; the caller then writes and :meth:`commit`s or
        :meth:`abort`s."""
        quota = self._quota.get(tenant)
        if span > self.region_bytes or span > self.capacity_bytes:
            return Refusal.TOO_LARGE
        if quota is not None and span > quota:
            return Refusal.TOO_LARGE
        mine = self._by_tenant.get(tenant, OrderedDict())
        if quota is not None and self.tenant_bytes(tenant) + span > quota:
            if self.tenant_bytes(tenant) - self._free_able(mine) + span > quota:
                return Refusal.QUOTA
        if self.used_bytes + span > self.capacity_bytes:
            if self.used_bytes - self._free_able(self._regions) + span > self.capacity_bytes:
                return Refusal.NO_SPACE
        # room is certain now: evict, least recently used first
        evicted: list[Evicted] = []
        while quota is not None and self.tenant_bytes(tenant) + span > quota:
            evicted.append(self._evict(self._victim(mine)))
        while self.used_bytes + span > self.capacity_bytes:
            evicted.append(self._evict(self._victim(self._regions)))
        active = self._regions.get(self._active.get(tenant, 0))
        fresh = active is None or active.end + span > self.region_bytes
        if fresh:
            active = _Region(tenant, self.next_region, 0)
            self.next_region += 1
            self._regions[active.id] = active
            self._by_tenant.setdefault(tenant, OrderedDict())[active.id] = active
            self._active[tenant] = active.id
        assert active is not None
        offset = active.end
        active.end += span
        active.pending.add(offset)
        self.used_bytes += span
        self._tenant_bytes[tenant] = self.tenant_bytes(tenant) + span
        self.touch(active.id)
        return Reservation(tenant, active.id, offset, span, fresh, tuple(evicted))

    @staticmethod
    def _free_able(regions: OrderedDict[int, _Region]) -> int:
        return sum(r.end for r in regions.values() if not r.pending)

    def commit(self, res: Reservation, key: str, size: int, seq: int, *,
               offset: Optional[int] = None, checksum: int = 0, last: bool = True) -> None:
        """A record of the batch reserved by ``res`` is written: ``key`` now maps to its
        value at ``offset`` (default: the reservation's) with ``checksum``; ``last``:
        the batch's last record (the reservation is no longer pending)."""
        self.commit_batch(res, [key], [size], [seq],
                          [res.offset if offset is None else offset], [checksum], last=last)

    def commit_batch(self, res: Reservation, keys: Sequence[str], sizes: Sequence[int],
                     seqs: Sequence[int], offsets: Sequence[int], checksums: Sequence[int],
                     *, last: bool = True) -> None:
        """:meth:`commit` of records of the batch reserved by ``res`` at once (parallel
        columns; ``offsets`` in the region file): one call per batch, its entries packed
        in one loop, where a call per record cost a batch of 256 about 0.3 ms."""
        r = self._regions.get(res.region)
        if r is None:  # cannot happen: a region with a write in flight is never evicted
            raise AssertionError(f"region {res.region} vanished under a write")
        if last:
            r.pending.discard(res.offset)
        entries = self._entries.setdefault(res.tenant, {})
        if (_native_commit is not None and type(seqs) is range and seqs.step == 1
                and type(keys) is list and type(sizes) is list and type(offsets) is list
                and type(checksums) is list):
            delta = _native_commit(entries, keys, sizes, seqs.start, offsets, checksums,
                                   res.region)
        else:
            region = res.region << _REGION_AT
            delta = 0
            for key, size, seq, offset, checksum in zip(keys, sizes, seqs, offsets,
                                                        checksums):
                old = entries.get(key)
                if old is not None:
                    delta -= (old >> _SIZE_AT) & _SIZE_MASK
                entries[key] = (region | (offset << _OFFSET_AT) | (size << _SIZE_AT)
                                | (seq << _SEQ_AT) | checksum)
                delta += size
        self._value_bytes[res.tenant] = self.value_bytes(res.tenant) + delta
        r.keys.extend(keys)

    def abort(self, res: Reservation) -> None:
        """The write reserved by ``res`` failed: its bytes stay used until the region
        goes, and the region is sealed (nothing is appended after a failed write)."""
        r = self._regions.get(res.region)
        if r is not None:
            r.pending.discard(res.offset)
            if self._active.get(res.tenant) == res.region:
                del self._active[res.tenant]

    def remove(self, tenant: str, key: str, seq: Optional[int] = None) -> Optional[Location]:
        """Forget ``key`` (only if its record has sequence ``seq`` when given)."""
        entries = self._entries.get(tenant)
        if entries is None or key not in entries:
            return None
        loc = Location.unpack(entries[key])
        if seq is not None and loc.seq != seq:
            return None
        del entries[key]
        self._value_bytes[tenant] -= loc.size
        return loc

    def drop_region(self, region: int) -> Optional[Evicted]:
        """Forget a region and every entry in it (its file is gone or unusable)."""
        r = self._regions.get(region)
        return None if r is None else self._evict(r)

    @staticmethod
    def _victim(regions: OrderedDict[int, _Region]) -> _Region:
        return next(r for r in regions.values() if not r.pending)

    def _evict(self, r: _Region) -> Evicted:
        entries = self._entries.get(r.tenant, {})
        gone: list[str] = []
        for key in r.keys:
            packed = entries.get(key)
            if packed is not None and _region_of(packed) == r.id:
                del entries[key]
                gone.append(key)
                self._value_bytes[r.tenant] -= Location.unpack(packed).size
        del self._regions[r.id]
        del self._by_tenant[r.tenant][r.id]
        if self._active.get(r.tenant) == r.id:
            del self._active[r.tenant]
        self.used_bytes -= r.end
        self._tenant_bytes[r.tenant] -= r.end
        return Evicted(r.tenant, r.id, tuple(gone))

    # --- recovery and checkpoints ----------------------------------------------------

    def restore_region(self, tenant: str, region: int, end: int) -> None:
        """Add a region found on disk (``end``: bytes it occupies), sealed, most recently
        used; regions are restored oldest first."""
        r = _Region(tenant, region, end)
        self._regions[region] = r
        self._by_tenant.setdefault(tenant, OrderedDict())[region] = r
        self.used_bytes += end
        self._tenant_bytes[tenant] = self.tenant_bytes(tenant) + end
        self.next_region = max(self.next_region, region + 1)

    def restore_scanned(self, tenant: str, region: int, keys: Sequence[str],
                        offsets: Sequence[int], sizes: Sequence[int], seqs: Sequence[int],
                        checksums: Sequence[int]) -> int:
        """Add the records one scan of ``region`` found on disk, as columns: the newest
        write of a key wins (over the checkpoint's entries and the other regions').
        Returns how many were kept (none when the region is unknown). Keys new to the
        index and distinct (a scan without a checkpoint, or of what came after it) go
        in by one comprehension and ``dict.update``: ~0.9 -> ~0.6-0.75 us a record
        (2-vCPU VM); otherwise one loop of ints, no :class:`Location` per record."""
        r = self._regions.get(region)
        if r is None or r.tenant != tenant:
            return 0
        entries = self._entries.setdefault(tenant, {})
        base = region << _REGION_AT
        kept = r.keys
        if entries.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            entries.update(zip(keys, [
                base | (off << _OFFSET_AT) | (size << _SIZE_AT) | (seq << _SEQ_AT) | x
                for off, size, seq, x in zip(offsets, sizes, seqs, checksums)]))
            kept += keys
            self._value_bytes[tenant] = self.value_bytes(tenant) + sum(sizes)
            return len(keys)
        added = 0
        before = len(kept)
        for key, off, size, seq, x in zip(keys, offsets, sizes, seqs, checksums):
            old = entries.get(key)
            if old is not None:
                if (old >> _SEQ_AT) & _SEQ_MASK >= seq:
                    continue
                added -= (old >> _SIZE_AT) & _SIZE_MASK
            entries[key] = base | (off << _OFFSET_AT) | (size << _SIZE_AT) | (seq << _SEQ_AT) | x
            added += size
            kept.append(key)
        self._value_bytes[tenant] = self.value_bytes(tenant) + added
        return len(kept) - before

    def restore_bulk(self, tenant: str, keys: list[str], regions: Sequence[int],
                     offsets: Sequence[int], sizes: Sequence[int], seqs: Sequence[int],
                     checksums: Sequence[int]) -> int:
        """Add a checkpoint's columns into a fresh index whose regions are restored
        (each key at most once); returns how many were kept. The
        packing and the dict are built by comprehension and ``dict.update`` and only one
        cheap loop remains (grouping keys by region): a million in ~1 s."""
        entries = self._entries.setdefault(tenant, {})
        entries.update(zip(keys, [
            (rid << _REGION_AT) | (off << _OFFSET_AT) | (size << _SIZE_AT) | (seq << _SEQ_AT) | x
            for rid, off, size, seq, x in zip(regions, offsets, sizes, seqs, checksums)]))
        groups = {rid: r.keys for rid, r in self._by_tenant.get(tenant, {}).items()}
        lost_bytes = 0
        lost = []
        for key, rid, size in zip(keys, regions, sizes):
            g = groups.get(rid)
            if g is None:
                lost.append(key)
                lost_bytes += size
            else:
                g.append(key)
        for key in lost:  # its region's file is gone
            del entries[key]
        self._value_bytes[tenant] = self.value_bytes(tenant) + sum(sizes) - lost_bytes
        return len(keys) - len(lost)

    def scan_from(self) -> Iterator[tuple[str, int, int]]:
        """(tenant, region, offset) per region, oldest first: records at or after the
        offset may be missing from a checkpoint taken now (writes in flight)."""
        for r in self._regions.values():
            yield r.tenant, r.id, min(r.pending) if r.pending else r.end

    def keys(self, tenant: str) -> list[str]:
        """The tenant's keys (a list, not a copy of the entries)."""
        return list(self._entries.get(tenant, ()))

    def entries(self, tenant: str) -> dict[str, int]:
        """A copy of the tenant's packed entries (``Location.unpack`` reads one)."""
        return dict(self._entries.get(tenant, {}))

    def check(self) -> None:
        """Assert the internal invariants (tests)."""
        assert self.used_bytes == sum(r.end for r in self._regions.values())
        for t, regs in self._by_tenant.items():
            assert self.tenant_bytes(t) == sum(r.end for r in regs.values())
        for t, entries in self._entries.items():
            assert self.value_bytes(t) == sum(Location.unpack(p).size for p in entries.values())
            for packed in entries.values():
                r = self._regions[_region_of(packed)]
                assert r.tenant == t
