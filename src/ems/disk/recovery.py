"""Recovery: the index rebuilt from the last checkpoint and a scan of what came after.

::

    open() --clean marker?--yes--> load checkpoint ------------------------> ok
               |                       (damaged/absent: scan every region)
               no
               v
         load checkpoint --> drop entries of regions whose file is gone
               |             --> remove region files it does not name whose id is
               |                 below its next region id (stale: evicted before it,
               |                 back after a power cut because the removal was not
               v                 durable yet)
         scan each region from the checkpoint's scan_from offset (0 for a region
         the checkpoint does not know), a batch at a time: a head whose magic,
         version, CRC or tenant fails is skipped a block at a time, a record whose
         value fails its checksum is dropped (counted); the newest seq of a key
         wins ------------------------------------------------------------------> ok

A region's ``scan_from`` is its end at the checkpoint, or the lowest offset of a write
that was still in flight then, so a record committed after the checkpoint is always
scanned. Region ids are never reused (an evicted region's file is deleted), so a
checkpoint's entry can never point into a different, newer file; and every read checks
the header's tenant, key and seq against the index and the value's checksum anyway.
A torn record (``kill -9`` mid-write) fails its checksum: a miss; a torn batch head
loses the batch's records (none of which the index served before the crash: a batch
enters the index only once its write returned). A store of the format version 1
(ems 0.1: a record per I/O, magic ``EMSR``) has no batch to find and its checkpoint
does not decode: it opens empty and its region files are reclaimed first. What a crash can undo
is only what the last checkpoint did not see: a record written after it and deleted
before the crash may come back, and a key rewritten after it whose new record's region
was evicted before the crash comes back with its earlier record (bytes that were stored
under that key and pass their checksum; ems keys name their content).
"""

from __future__ import annotations

import importlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Protocol

from ems.disk.index import DiskIndex
from ems.disk.io import LOCAL, FileSystem, read_file
from ems.disk.records import (
    ALIGN,
    BATCH_FIXED_BYTES,
    BatchHead,
    Checkpoint,
    checksums,
    decode_checkpoint,
    parse_batch_fixed,
    parse_batch_head,
    round_up,
)

__all__ = ["CHECKPOINT", "CLEAN_MARKER", "Recovered", "Scanned", "recover", "region_path",
           "scan_region", "tenant_dir"]

log = logging.getLogger(__name__)

CHECKPOINT = "index.ckpt"
CLEAN_MARKER = "clean"
_SUFFIX = ".region"
#: bytes a scan reads per pread (records inside are parsed from memory)
SCAN_READ_BYTES = 8 << 20
#: a scan reads on from a head when fewer bytes than this are left in its buffer (a
#: longer head is read again whole: a full 8 MiB write buffer of 16 KiB values with
#: 64-byte keys has a head of ~48 KiB)
HEAD_WINDOW = 64 << 10
#: region files scanned at once: their reads (from the device after a power cut) and
#: their native steps side by side. 100,000 records of 4 KiB saved alone, scanned with
#: 1 and with 4 (two runs each, 2-vCPU VM): 2.6-3.1 -> 1.9-2.2 s per million in the
#: page cache, 5.5-7.5 -> 5.3-5.5 with its pages dropped first
SCAN_THREADS = 4


class _ScanBatches(Protocol):
    """``ems._native.scan_batches`` (``src/ems/_native.c``): from ``rel`` of ``buf``
    (the file's bytes from ``buf_at`` on), while ``window`` bytes are left, each batch
    of ``tenant`` that lies whole in the buffer parsed and checked, and its records
    whose checksums match appended to the five columns; where it stopped (the first
    head it did not take) and how many records failed their checksum."""

    def __call__(self, buf: memoryview, rel: int, window: int, tenant: bytes, buf_at: int,
                 keys: list[str], offsets: list[int], sizes: list[int], seqs: list[int],
                 checksums: list[int], /) -> tuple[int, int]: ...


def _native_scan_batches() -> Optional[_ScanBatches]:
    try:
        fn: _ScanBatches = importlib.import_module("ems._native").scan_batches
        return fn
    except (ImportError, AttributeError):  # pragma: no cover - no compiler at install
        return None


#: the scan's step over the whole batches of its buffer in one native call, where it
#: was built (None: a head at a time in Python, :func:`parse_batch_head`)
_scan_batches = _native_scan_batches()


def tenant_dir(root: str, tenant: str) -> str:
    """The tenant's directory: ``t`` + the hex of its UTF-8 name (any name is safe)."""
    return os.path.join(root, "t" + tenant.encode().hex())


def region_path(root: str, tenant: str, region: int) -> str:
    return os.path.join(tenant_dir(root, tenant), f"{region:016x}{_SUFFIX}")


@dataclass(frozen=True)
class Recovered:
    """What recovery found."""

    index: DiskIndex
    next_seq: int
    records_recovered: int
    records_dropped_damaged: int
    records_scanned: int
    scan_skipped: bool
    checkpoint_loaded: bool
    #: regions in which the scan found records (not known to be durable yet)
    scanned_regions: frozenset[int] = frozenset()
    #: region files removed as stale: evicted before the checkpoint, their removal
    #: not durable when the power went
    stale_regions_removed: int = 0


@dataclass(frozen=True)
class _File:
    tenant: str
    region: int
    size: int


def _region_files(fs: FileSystem, root: str) -> dict[int, _File]:
    found: dict[int, _File] = {}
    for d in fs.list_dir(root):
        if not d.is_dir or not d.name.startswith("t"):
            continue
        try:
            tenant = bytes.fromhex(d.name[1:]).decode()
        except ValueError:
            continue
        for f in fs.list_dir(os.path.join(root, d.name)):
            if not f.is_file or not f.name.endswith(_SUFFIX):
                continue
            try:
                rid = int(f.name[:-len(_SUFFIX)], 16)
            except ValueError:
                continue
            found[rid] = _File(tenant, rid, f.size)
    return found


def _load_checkpoint(fs: FileSystem, root: str) -> Optional[Checkpoint]:
    try:
        data = read_file(fs, os.path.join(root, CHECKPOINT))
    except FileNotFoundError:
        return None
    ck = decode_checkpoint(data)
    if ck is None:
        log.warning("disk store %s: the checkpoint is damaged; scanning every region", root)
    return ck


@dataclass
class Scanned:
    """The valid records one region's scan found, as columns (``DiskIndex.
    restore_scanned`` takes them whole: no object per record)."""

    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    #: records of a valid batch head whose value fails its checksum or runs past the
    #: end of the file
    damaged: int = 0

    def check(self, tenant: bytes, found: _Found) -> None:
        """Take the records ``found`` holds whose values match their checksums, count
        the others damaged, and empty it. One call of :func:`checksums` for the records
        of a whole read buffer, and the columns extended whole where every one matches
        (the usual case): no Python step per record. (One by one, a record saved alone
        cost ~1.3 us of Python to check, ~0.5 in one native call a head: 4 KiB.)"""
        if not found.keys:
            return
        sums = checksums(tenant, list(map(str.encode, found.keys)), found.seqs, found.values)
        if sums != found.xxh3s:
            found.drop([i for i, (got, want) in enumerate(zip(sums, found.xxh3s))
                        if got != want])
            self.damaged += len(sums) - len(found.keys)
        self.keys += found.keys
        self.offsets += found.ats
        self.sizes += found.value_lens
        self.seqs += found.seqs
        self.checksums += found.xxh3s
        found.clear()


class _Found:
    """Records a scan found in its read buffer and has not checked yet (columns; the
    values are views of the buffer, checked before it is read into again)."""

    __slots__ = ("ats", "keys", "seqs", "value_lens", "values", "xxh3s")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.seqs: list[int] = []
        self.value_lens: list[int] = []
        self.xxh3s: list[int] = []
        self.ats: list[int] = []  # each value's offset in the file
        self.values: list[memoryview] = []

    def add(self, head: BatchHead, pos: int, buf: memoryview, buf_at: int) -> None:
        """Every record of ``head`` (the batch at ``pos`` in the file), whose values
        all lie in ``buf`` (the file's bytes from ``buf_at`` on)."""
        self.keys += head.keys
        self.seqs += head.seqs
        self.value_lens += head.value_lens
        self.xxh3s += head.xxh3s
        rel = pos - buf_at
        self.ats += [pos + off for off in head.offsets]
        self.values += [buf[rel + off:rel + off + n]
                        for off, n in zip(head.offsets, head.value_lens)]

    def add_one(self, head: BatchHead, i: int, at: int, value: memoryview) -> None:
        """Record ``i`` of ``head``, its value at ``at`` in the file."""
        self.keys.append(head.keys[i])
        self.seqs.append(head.seqs[i])
        self.value_lens.append(head.value_lens[i])
        self.xxh3s.append(head.xxh3s[i])
        self.ats.append(at)
        self.values.append(value)

    def drop(self, damaged: list[int]) -> None:
        """Forget the records at the indices ``damaged``."""
        for i in reversed(damaged):
            for column in (self.keys, self.seqs, self.value_lens, self.xxh3s, self.ats,
                           self.values):
                del column[i]

    def clear(self) -> None:
        for column in (self.keys, self.seqs, self.value_lens, self.xxh3s, self.ats,
                       self.values):
            column.clear()


def scan_region(fs: FileSystem, path: str, tenant: str, start: int) -> Scanned:
    """The valid records of ``tenant`` in the region file at ``path`` from ``start``
    on, each value's checksum verified. The file is read into one reused buffer of
    :data:`SCAN_READ_BYTES` (a fresh one per read faulted in two pages per record of
    4 KiB saved alone) and every head parsed in place in it. The batches that lie
    whole in the buffer go through one native call (:data:`_scan_batches`: parsed,
    checked and appended without a Python step per head; a batch that runs past the
    buffer is read again from its head when it fits one); the heads it leaves (garbage,
    another tenant's, a batch larger than the buffer) and every head where it was not
    built take the Python step: :func:`parse_batch_head`, a head's records taken as
    columns and checked a buffer at a time (:meth:`Scanned.check`)."""
    out = Scanned()
    tb = tenant.encode()
    found = _Found()
    native = _scan_batches
    space = bytearray(SCAN_READ_BYTES)
    fd = fs.open_file(path)
    try:
        size = fs.file_size(fd)

        def fill(at: int, need: int) -> memoryview:
            """The file's bytes from ``at`` on (at least ``need`` of them where the file
            has them), read into the reused buffer (the records found in it before are
            checked first)."""
            nonlocal space
            out.check(tb, found)
            if need > len(space):
                space = bytearray(need)
            n = min(len(space), size - at)
            view = memoryview(space)[:n]
            got = fs.read_at(fd, [view], at)
            return view[:got]

        buf = memoryview(b"")
        buf_at = buf_end = pos = start  # the buffer holds the file's [buf_at, buf_end)
        while pos + BATCH_FIXED_BYTES <= size:
            rel = pos - buf_at
            if rel < 0 or (pos + HEAD_WINDOW > buf_end and buf_end < size):
                buf.release()
                buf, buf_at, rel = fill(pos, SCAN_READ_BYTES), pos, 0
                buf_end = pos + len(buf)
            if native is not None:  # every whole batch of the buffer in one call
                if found.keys:  # (in the file's order)
                    out.check(tb, found)
                rel, damaged = native(buf, rel, HEAD_WINDOW if buf_end < size
                                      else BATCH_FIXED_BYTES, tb, buf_at, out.keys,
                                      out.offsets, out.sizes, out.seqs, out.checksums)
                out.damaged += damaged
                if buf_at + rel != pos:
                    pos = buf_at + rel
                    continue
            # (a head the native step did not take: garbage, another tenant's, past
            # the buffer; every head without it)
            head = parse_batch_head(buf, tenant, rel)
            if head is None:  # garbage, another tenant's, or a head past the buffer
                fixed = parse_batch_fixed(buf, rel)
                if (fixed is not None and pos + fixed.head_len > buf_end
                        and pos + fixed.head_len <= size):
                    buf.release()
                    buf, buf_at, rel = fill(pos, fixed.head_len), pos, 0
                    buf_end = pos + len(buf)
                    head = parse_batch_head(buf, tenant, rel)
                if head is None:
                    pos += ALIGN
                    continue
            last = pos + head.offsets[-1] + head.value_lens[-1]  # (values are in order)
            if last <= buf_end:  # (and so inside the file)
                found.add(head, pos, buf, buf_at)
            elif buf_at < pos and last - pos <= SCAN_READ_BYTES and last <= size:
                # the batch runs past the buffer and fits one: read on from its head,
                # and take it whole (the native step, not a value at a time)
                buf.release()
                buf, buf_at = fill(pos, SCAN_READ_BYTES), pos
                buf_end = pos + len(buf)
                continue
            else:  # larger than a buffer, or the file ends inside it
                for i, (off, vlen) in enumerate(zip(head.offsets, head.value_lens)):
                    at = pos + off
                    if at + vlen > size:
                        out.damaged += 1
                        continue
                    if at + vlen > buf_end:
                        buf.release()
                        buf, buf_at = fill(at, vlen), at
                        buf_end = at + len(buf)
                    found.add_one(head, i, at, buf[at - buf_at:at - buf_at + vlen])
            pos += head.span
        out.check(tb, found)
    finally:
        fs.close(fd)
    return out


def recover(root: str, capacity_bytes: int, region_bytes: int, clean: bool,
            fs: FileSystem = LOCAL) -> Recovered:
    """The index of the store in ``root`` (see the module's state machine)."""
    ck = _load_checkpoint(fs, root)
    files = _region_files(fs, root)
    index = DiskIndex(capacity_bytes, region_bytes)
    scan_from: dict[int, int] = {}
    if ck is not None:
        index.next_region = ck.next_region
        for r in ck.regions:  # oldest (least recently used) first
            f = files.get(r.region)
            if f is not None and f.tenant == r.tenant:
                index.restore_region(f.tenant, f.region, round_up(f.size))
                scan_from[f.region] = r.scan_from
    stale = 0
    for rid in sorted(files):
        if rid not in scan_from:
            f = files[rid]
            if ck is not None and rid < ck.next_region:
                # made before the checkpoint and not in it: evicted before it; the file
                # is back because its removal was not durable yet (a power cut)
                fs.unlink(region_path(root, f.tenant, rid))
                stale += 1
                continue
            index.restore_region(f.tenant, rid, round_up(f.size))
            scan_from[rid] = 0
    next_seq = 1
    if ck is not None:
        next_seq = ck.next_seq
        for t in ck.tenants:
            index.restore_bulk(t.tenant, t.keys, t.regions, t.offsets, t.sizes, t.seqs,
                               t.checksums)
    skip = clean and ck is not None
    damaged = 0
    scanned = 0
    scanned_regions = set()
    if not skip:
        todo = [(rid, start) for rid, start in scan_from.items() if files[rid].size > start]

        def scan(item: tuple[int, int]) -> Optional[Scanned]:
            rid, start = item
            f = files[rid]
            try:
                return scan_region(fs, region_path(root, f.tenant, rid), f.tenant, start)
            except FileNotFoundError:
                return None
        # (in the regions' order, each restored as its scan ends: the newest seq of a
        # key wins whatever the order)
        with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="ems-scan") as pool:
            for (rid, _), found in zip(todo, pool.map(scan, todo)):
                if found is None:
                    index.drop_region(rid)
                    continue
                damaged += found.damaged
                if found.keys:
                    scanned += len(found.keys)
                    scanned_regions.add(rid)
                    next_seq = max(next_seq, max(found.seqs) + 1)
                    index.restore_scanned(files[rid].tenant, rid, found.keys, found.offsets,
                                          found.sizes, found.seqs, found.checksums)
    return Recovered(index, next_seq, index.objects(), damaged, scanned, skip, ck is not None,
                     frozenset(scanned_regions), stale)
