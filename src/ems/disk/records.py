"""The on-disk formats, pure: a write buffer's record batch and the index checkpoint.

No file, clock or thread here: bytes in, values out, so both formats are
property-tested (``decode(encode(x)) == x``, and any flipped byte is rejected).

A region file is a sequence of *batches* (CacheLib Navy's region buffers: one write
buffer, one I/O), each starting at a multiple of :data:`ALIGN`::

    batch offset 0
    +------+---+---+----+-----+--------+------+---+--------+------------------+
    |magic |ver|flg|hcrc|count|head_len| span |tl | tenant | count entries:   |
    | EMSB | H | H | I  |  I  |   I    |  Q   | H |        | off seq vlen xxh3|
    |      |   |   |    |     |        |      |   |        | kl key (30+kl B) |
    +------+---+---+----+-----+--------+------+---+--------+------------------+
    | value 0 | value 1 | ... (each at its entry's offset)  | zeros up to span |
    +--------------------------------------------------------------------------+

* A value whose length is a multiple of :data:`ALIGN` starts on an ``ALIGN`` boundary,
  so it moves with ``O_DIRECT`` straight between the file and a page-aligned buffer (a
  KV block of 16 KiB-1 MiB always does); any other value follows the previous one at 8
  bytes. The batch's end is rounded up to ``ALIGN`` (``span``), so the next batch is
  aligned: the padding is per batch, never per record. A head of 64 records of 16 KiB
  with 64-byte keys is ~6 KiB, one 8 KiB pad: 0.8 % of the batch's 1 MiB; 512 records
  (the default 8 MiB write buffer) 0.6 %. The format version 1 of ems 0.1 gave every
  record a 4 KiB header block (25 % of a 16 KiB value).
* ``hcrc`` is a CRC-32 of the head's ``head_len`` bytes with ``hcrc`` zeroed: a scan
  rejects garbage (a torn or never-written block, the middle of a value) from the head
  alone, without reading a value.
* ``xxh3`` of an entry is :func:`record_checksum`: XXH3-64 of the record's identity
  (sequence number, length, tenant, key) followed by the value. The index keeps it, so
  a read moves the value alone (one I/O, no header) and checks the bytes that landed
  in the caller's buffer against it: a torn, damaged or stale record is a miss, never
  wrong bytes.
* Version 1 records (magic ``EMSR``) and checkpoints (``EMSCKPT1``) do not parse: a store
  of ems 0.1 opens empty (every old object a miss) and its regions are reclaimed first.

The checkpoint (``index.ckpt``) is columnar so a million records load in well under a
second (``benchmarks/disk_store.py``): a fixed header, the tenant names, the region
table, then per tenant the entries as packed ``array`` columns and one UTF-8 blob of
the keys, and an XXH3-64 of everything before it as a trailer. A damaged checkpoint is
ignored as a whole (recovery then scans every region).
"""

from __future__ import annotations

import functools
import importlib
import math
import operator
import struct
import zlib
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, NamedTuple, Optional, Sequence, Union

import xxhash

__all__ = [
    "ALIGN", "BATCH_FIXED_BYTES", "ENTRY_FIXED_BYTES", "MAX_NAME_BYTES", "VERSION",
    "BatchFixed", "BatchHead", "BatchLayout", "Checkpoint", "CheckpointRegion", "CheckpointTenant",
    "Entry", "checksum", "checksums", "decode_checkpoint", "encode_batch", "encode_batch_head",
    "encode_checkpoint",
    "layout", "parse_batch_fixed", "parse_batch_head", "record_checksum", "record_span",
    "round_up",
]

#: Alignment of every batch (and of every value whose length is a multiple of it):
#: O_DIRECT's unit.
ALIGN = 4096
#: Alignment of a value whose length is not a multiple of :data:`ALIGN`.
PACK = 8

MAGIC = b"EMSB"
#: The on-disk format's version (1: ems 0.1's record per I/O with a 4 KiB header).
VERSION = 2
_BATCH = struct.Struct("<4sHHIIIQH")  # magic ver flags hcrc count head_len span tl
_ENTRY = struct.Struct("<IQQQH")  # offset-in-batch seq vlen xxh3 kl
_IDENT = struct.Struct("<QQHH")  # what record_checksum binds: seq vlen tl kl
BATCH_FIXED_BYTES = _BATCH.size
ENTRY_FIXED_BYTES = _ENTRY.size
#: The longest tenant + key (UTF-8 bytes): a batch of one record has a one-block head.
MAX_NAME_BYTES = ALIGN - _BATCH.size - _ENTRY.size
_HCRC_AT = struct.calcsize("<4sHH")  # offset of hcrc in the fixed part
#: The most bytes a batch of more than one record spans (an entry's offset is 32-bit).
MAX_BATCH_BYTES = 1 << 32

Buffer = Union[bytes, bytearray, memoryview]


def round_up(n: int, unit: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``unit``."""
    return -(-n // unit) * unit


def record_span(value_len: int) -> int:
    """The most bytes a record with a ``value_len``-byte value occupies in its region
    (written alone: a one-block head, the value, the batch's end rounded up)."""
    return ALIGN + round_up(value_len)


class Entry(NamedTuple):
    """One record of a batch: its key, write sequence number, value length, checksum
    (:func:`record_checksum`) and the value's offset from the batch's start. (A named
    tuple: a scan makes one per record, and a frozen dataclass cost 1 us each.)"""

    key: str
    seq: int
    value_len: int
    xxh3: int
    offset: int


@dataclass(frozen=True)
class BatchLayout:
    """Where a batch's parts go: the head's length, each value's offset from the batch's
    start, and the bytes the batch spans (a multiple of :data:`ALIGN`)."""

    head_len: int
    offsets: tuple[int, ...]
    span: int
    #: every value starts where the one before it ends (values of whole blocks)
    packed: bool = False


class BatchHead(NamedTuple):
    """A parsed batch head, its entries as columns in the head's order (a scan takes
    them whole: no object per record; :attr:`entries` makes them one by one). (A named
    tuple: a scan parses one per save, and a frozen dataclass cost ~1 us of a record
    saved alone.)"""

    tenant: str
    span: int
    head_len: int
    keys: tuple[str, ...]
    seqs: tuple[int, ...]
    value_lens: tuple[int, ...]
    xxh3s: tuple[int, ...]
    #: each value's offset from the batch's start
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, tenant: str, span: int, head_len: int, entries: Sequence[Entry]
           ) -> "BatchHead":
        """The head of ``entries`` (made one by one: tests, tools)."""
        return cls(tenant, span, head_len, tuple(e.key for e in entries),
                   tuple(e.seq for e in entries), tuple(e.value_len for e in entries),
                   tuple(e.xxh3 for e in entries), tuple(e.offset for e in entries))

    @property
    def entries(self) -> tuple[Entry, ...]:
        """The entries one by one."""
        return tuple(map(Entry, self.keys, self.seqs, self.value_lens, self.xxh3s,
                         self.offsets))


def layout(tenant: bytes, keys: Sequence[bytes], value_lens: Sequence[int]) -> BatchLayout:
    """The layout of a batch of ``tenant``'s records (UTF-8 ``keys`` and the lengths of
    their values); raises ``ValueError`` when tenant + a key exceed
    :data:`MAX_NAME_BYTES`. Values of whole blocks (KV blocks) follow each other from
    the first block after the head: their offsets are one running sum."""
    tl = len(tenant)
    klens = [len(kb) for kb in keys]
    if klens and tl + max(klens) > MAX_NAME_BYTES:
        raise ValueError(f"tenant + key are {tl + max(klens)} bytes, at most "
                         f"{MAX_NAME_BYTES}")
    head = _BATCH.size + tl + _ENTRY.size * len(keys) + sum(klens)
    at = round_up(head)
    if not value_lens:
        return BatchLayout(head, (), at)
    if not math.gcd(*value_lens) % ALIGN:  # (every one a multiple: at C speed)
        offsets = tuple(accumulate(value_lens[:-1], initial=at))
        return BatchLayout(head, offsets, round_up(offsets[-1] + value_lens[-1]), True)
    at = head
    spread = []
    for n in value_lens:  # a value of whole blocks on a block, any other at 8 bytes
        at = round_up(at, PACK if n % ALIGN else ALIGN)
        spread.append(at)
        at += n
    return BatchLayout(head, tuple(spread), round_up(at))


def record_checksum(tenant: str, key: str, seq: int, value: Buffer) -> int:
    """XXH3-64 of the record's identity (``seq``, the value's length, ``tenant``,
    ``key``) followed by ``value``: what a read checks the bytes it got against."""
    return checksum(tenant.encode(), key.encode(), seq, value)


_xxh3 = xxhash.xxh3_64


def checksum(tenant: bytes, key: bytes, seq: int, value: Buffer) -> int:
    """:func:`record_checksum` of a UTF-8 ``tenant`` and ``key`` (a batch's writer and
    a scan have them encoded already)."""
    n = value.nbytes if isinstance(value, memoryview) else len(value)
    h = _xxh3(_IDENT.pack(seq, n, len(tenant), len(key)) + tenant + key)
    h.update(value)
    return h.intdigest()


def _native_checksums() -> Optional[Callable[[bytes, list[bytes], Sequence[int],
                                               list[memoryview]], list[int]]]:
    try:
        return importlib.import_module("ems._native").checksums
    except (ImportError, AttributeError):  # pragma: no cover - no compiler at install
        return None


#: ``ems._native.checksums``: a batch's checksums in one call (None without it)
_batch_checksums = _native_checksums()


def checksums(tenant: bytes, keys: list[bytes], seqs: Sequence[int],
              values: list[memoryview]) -> list[int]:
    """:func:`checksum` of each record of a batch (parallel columns). In one call of
    the native helper where it was built (``src/ems/_native.c``: the xxHash library's
    XXH3, hashed with the GIL released), ~1.3 -> ~0.5 us a 4 KiB record and, of a 16
    KiB record's ~1.6 us, ~0.1 with the GIL held (2-vCPU VM): a scan checks every
    record, and the daemon's writers share one interpreter with its loop. One by one
    through the ``xxhash`` package otherwise; the same values either way."""
    if _batch_checksums is not None:
        return _batch_checksums(tenant, keys, seqs, values)
    return [checksum(tenant, kb, seq, v) for kb, seq, v in zip(keys, seqs, values)]


def _native_encode() -> Optional[Callable[[bytes, list[bytes], int, list[memoryview],
                                            list[int], int], tuple[bytearray, list[int]]]]:
    try:
        return importlib.import_module("ems._native").encode_batch
    except (ImportError, AttributeError):  # pragma: no cover - no compiler at install
        return None


#: ``ems._native.encode_batch``: a batch's head and checksums in one call (None without)
_native_encode_batch = _native_encode()


def encode_batch(tenant: bytes, keys: list[bytes], first_seq: int, values: list[memoryview],
                 offsets: list[int], span: int) -> tuple[bytearray, list[int]]:
    """A batch's head (:func:`encode_batch_head`) and its records' checksums
    (:func:`checksums`), the records' sequence numbers counting from ``first_seq``.
    One call of the native helper where it was built: the head's entries packed in C
    beside the checksums (a writer of the daemon shares one interpreter with its event
    loop; 256 values of 16 KiB, 2-vCPU VM: 1.08 -> 0.97 us a value, 0.8 of it the
    hashing); the same bytes either way (``tests/disk/test_disk_records.py``)."""
    if _native_encode_batch is not None:
        return _native_encode_batch(tenant, keys, first_seq, values, offsets, span)
    seqs = range(first_seq, first_seq + len(keys))
    sums = checksums(tenant, keys, seqs, values)
    return encode_batch_head(tenant, keys, seqs, [v.nbytes for v in values], sums, offsets,
                             span), sums


def encode_batch_head(tenant: bytes, keys: Sequence[bytes], seqs: Sequence[int],
                      value_lens: Sequence[int], checksums: Sequence[int],
                      offsets: Sequence[int], span: int) -> bytearray:
    """The head of a batch of records (parallel columns: UTF-8 keys, sequence numbers,
    value lengths, checksums (:func:`record_checksum`), offsets from the batch's start)
    spanning ``span`` bytes (``head_len`` bytes long; the caller pads it to its first
    value)."""
    out = bytearray(_BATCH.size)
    out += tenant
    pack = _ENTRY.pack
    for kb, seq, n, xxh, off in zip(keys, seqs, value_lens, checksums, offsets):
        out += pack(off, seq, n, xxh, len(kb))
        out += kb
    _BATCH.pack_into(out, 0, MAGIC, VERSION, 0, 0, len(keys), len(out), span, len(tenant))
    struct.pack_into("<I", out, _HCRC_AT, zlib.crc32(out))
    return out


class BatchFixed(NamedTuple):
    """The fixed part of a batch head: how long the head is and how many bytes the
    batch spans (what a scan needs when its buffer ends inside a head)."""

    head_len: int
    span: int


def parse_batch_fixed(block: Buffer, at: int = 0) -> Optional[BatchFixed]:
    """The fixed part of the batch head starting at offset ``at`` of ``block``, or None
    when it does not start with a version-2 batch head (the rest is checked by
    :func:`parse_batch_head`)."""
    if len(block) - at < _BATCH.size:
        return None
    magic, ver, _flags, _hcrc, count, head_len, span, tl = _BATCH.unpack_from(block, at)
    if (magic != MAGIC or ver != VERSION or span % ALIGN or span < head_len
            or head_len < _BATCH.size + tl + count * _ENTRY.size):
        return None
    return BatchFixed(head_len, span)


class _Lead(NamedTuple):
    """What a head of a tenant starts with: its UTF-8 name, and the struct of the
    head's fixed part, that name and the first entry (one unpack for a record saved
    alone)."""

    name: bytes
    struct: struct.Struct


@functools.lru_cache(maxsize=256)
def _lead(tenant: str) -> _Lead:
    tb = tenant.encode()
    return _Lead(tb, struct.Struct(f"{_BATCH.format}{len(tb)}s{_ENTRY.format[1:]}"))


#: CRC-32 of the head's first bytes up to ``hcrc``'s end, ``hcrc`` zeroed, as every
#: version-2 head starts (no flags): the head's CRC goes on from here
_CRC_LEAD = zlib.crc32(struct.pack("<4sHH", MAGIC, VERSION, 0) + b"\0" * 4)


@functools.lru_cache(maxsize=64)
def _rows(key_len: int) -> struct.Struct:
    """An entry and its key of ``key_len`` bytes (the entries of a batch whose keys are
    all that long, V1's hashes: one ``iter_unpack`` for them all)."""
    return struct.Struct(f"{_ENTRY.format}{key_len}s")


#: a named tuple made from a tuple of its fields without the call of its ``__new__``
#: (a Python function): ~0.4 -> ~0.15 us a :class:`BatchHead` (2-vCPU VM), one a head
_new = tuple.__new__

#: an entry of a head as read: offset, sequence number, value length, checksum, key
#: length, the key's bytes
_Row = tuple[int, int, int, int, int, bytes]


def parse_batch_head(block: Buffer, tenant: str, at: int = 0) -> Optional[BatchHead]:
    """The batch head of ``tenant`` at offset ``at`` of ``block``, or None when there is
    no valid one there (magic, version, CRC, lengths, offsets, UTF-8, another tenant's,
    or ``block`` ends inside it: :func:`parse_batch_fixed` says how long it is).

    Parsed in place: a scan hands it its read buffer, and the head's fixed part, the
    tenant's name and the first entry come out of one unpack (a struct per tenant),
    the CRC goes on from the constant lead of every head. A scan of records saved one
    at a time parses one head per record: a head of one record parses in ~2.9 us this
    way, where a fixed part, then a CRC of three slices and an unpack per entry took
    ~4.6 us (2-vCPU VM; the whole scan went from ~9 to ~6 us a record). The entries
    after the first, when their keys are as long as its key (a save's V1 hashes), come
    out of one ``iter_unpack``, and they are checked and turned into columns by
    builtins over whole columns (:func:`_columns`), never a Python step per entry: a
    head of 64 records ~1.4 -> ~0.8 us a record (one ``iter_unpack``), then ~0.9 ->
    ~0.4 us (columns, no :class:`Entry` per record)."""
    lead = _lead(tenant)
    tb = lead.name
    try:
        (magic, ver, flags, hcrc, count, head_len, span, tl, name, off, seq, vlen, xxh, kl
         ) = lead.struct.unpack_from(block, at)
    except struct.error:
        return None
    if (magic != MAGIC or ver != VERSION or flags or name != tb or tl != len(tb)
            or count < 1 or span % ALIGN or span < head_len or len(block) - at < head_len):
        return None
    view = memoryview(block)
    if zlib.crc32(view[at + _HCRC_AT + 4:at + head_len], _CRC_LEAD) != hcrc:
        return None
    pos = at + lead.struct.size
    end = at + head_len
    if count == 1:  # a record saved alone: its one entry, checked here (through a list
        # of rows and the columns it cost ~1 us more, of a head that parses in ~2.5 us)
        if pos + kl != end or off < head_len or off + vlen > span or tl + kl > MAX_NAME_BYTES:
            return None
        try:
            key = str(view[pos:end], "utf-8")
        except UnicodeDecodeError:
            return None
        return _new(BatchHead, (tenant, span, head_len, (key,), (seq,), (vlen,), (xxh,),
                                (off,)))
    if pos + kl > end:
        return None
    first: _Row = (off, seq, vlen, xxh, kl, bytes(view[pos:pos + kl]))
    pos += kl
    same = _rows(kl)
    if end - pos == (count - 1) * same.size:
        rows = [first]
        rows += same.iter_unpack(view[pos:end])
        try:
            return _columns(rows, tenant, span, head_len, tl, one_length=True)
        except _OtherLengths:  # keys of other lengths that add up to as many bytes
            pass
    rows = [first]
    if _rows_apart(view, pos, end, count - 1, rows) != end:
        return None
    return _columns(rows, tenant, span, head_len, tl, one_length=False)


class _OtherLengths(Exception):
    """:func:`_columns` was told every key is as long as the first, and one is not."""


def _columns(rows: list[_Row], tenant: str, span: int, head_len: int, tl: int, *,
             one_length: bool) -> Optional[BatchHead]:
    """The head of ``rows``, checked (each value after the head and after the value
    before it, inside the batch; names not too long; keys UTF-8), or None where one
    fails; :class:`_OtherLengths` raised when ``one_length`` and a key's length is not
    the first's (the rows were read at the first key's length: read them one by
    one)."""
    offs, seqs, vlens, xxhs, kls, kbs = zip(*rows)
    if one_length and kls.count(kls[0]) != len(kls):
        raise _OtherLengths
    ends = tuple(map(operator.add, offs, vlens))  # non-decreasing once the offsets pass
    if (offs[0] < head_len or ends[-1] > span or tl + max(kls) > MAX_NAME_BYTES
            or not all(map(operator.le, ends, offs[1:]))):
        return None
    try:
        keys = tuple(map(bytes.decode, kbs))
    except UnicodeDecodeError:
        return None
    return _new(BatchHead, (tenant, span, head_len, keys, seqs, vlens, xxhs, offs))


def _rows_apart(view: memoryview, pos: int, end: int, count: int, rows: list[_Row]) -> int:
    """Append ``count`` entries read one by one from ``pos`` (keys of any length) to
    ``rows``; where they end, or -1 when they run past ``end``."""
    unpack, size = _ENTRY.unpack_from, _ENTRY.size
    for _ in range(count):
        if pos + size > end:
            return -1
        off, seq, vlen, xxh, kl = unpack(view, pos)
        pos += size
        if pos + kl > end:
            return -1
        rows.append((off, seq, vlen, xxh, kl, bytes(view[pos:pos + kl])))
        pos += kl
    return pos


# --- the checkpoint ------------------------------------------------------------------

_CK_MAGIC = b"EMSCKPT2"  # 1: ems 0.1 (no checksum column)
_CK_HEAD = struct.Struct("<8sQQII")  # magic next_seq next_region n_tenants n_regions
_CK_REGION = struct.Struct("<IQQ")  # tenant index, region id, scan_from


@dataclass(frozen=True)
class CheckpointRegion:
    """A region known to the checkpoint: records from ``scan_from`` on may be newer."""

    tenant: str
    region: int
    scan_from: int


@dataclass(frozen=True)
class CheckpointTenant:
    """One tenant's entries as parallel columns (the index's compact form)."""

    tenant: str
    keys: list[str]
    regions: array  # 'Q'
    offsets: array  # 'Q'
    sizes: array  # 'Q'
    seqs: array  # 'Q'
    checksums: array  # 'Q': each record's :func:`record_checksum`


@dataclass(frozen=True)
class Checkpoint:
    """Everything a restart needs besides the region files themselves."""

    next_seq: int
    next_region: int
    regions: list[CheckpointRegion]
    tenants: list[CheckpointTenant]


def encode_checkpoint(ck: Checkpoint) -> bytes:
    """The checkpoint file's bytes."""
    names = sorted({r.tenant for r in ck.regions} | {t.tenant for t in ck.tenants})
    where = {n: i for i, n in enumerate(names)}
    out = bytearray(_CK_HEAD.pack(_CK_MAGIC, ck.next_seq, ck.next_region, len(names),
                                  len(ck.regions)))
    for n in names:
        b = n.encode()
        out += struct.pack("<I", len(b)) + b
    for r in ck.regions:
        out += _CK_REGION.pack(where[r.tenant], r.region, r.scan_from)
    by_name = {t.tenant: t for t in ck.tenants}
    for n in names:
        t = by_name.get(n)
        keys = t.keys if t else []
        blob = "".join(keys).encode()
        out += struct.pack("<QQ", len(keys), len(blob))
        if t is None:
            continue
        lens = array("Q", [len(k) for k in keys])
        for col in (t.regions, t.offsets, t.sizes, t.seqs, t.checksums, lens):
            out += col.tobytes()
        out += blob
    out += struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(out)))
    return bytes(out)


def decode_checkpoint(data: bytes) -> Optional[Checkpoint]:
    """The checkpoint in ``data``, or None when it is damaged or not a checkpoint."""
    try:
        if len(data) < _CK_HEAD.size + 8:
            return None
        (want,) = struct.unpack_from("<Q", data, len(data) - 8)
        if xxhash.xxh3_64_intdigest(data[:-8]) != want:
            return None
        magic, next_seq, next_region, n_names, n_regions = _CK_HEAD.unpack_from(data, 0)
        if magic != _CK_MAGIC:
            return None
        at = _CK_HEAD.size
        names = []
        for _ in range(n_names):
            (n,) = struct.unpack_from("<I", data, at)
            names.append(data[at + 4:at + 4 + n].decode())
            at += 4 + n
        regions = []
        for _ in range(n_regions):
            ti, rid, scan_from = _CK_REGION.unpack_from(data, at)
            regions.append(CheckpointRegion(names[ti], rid, scan_from))
            at += _CK_REGION.size
        tenants = []
        for name in names:
            count, blob_len = struct.unpack_from("<QQ", data, at)
            at += 16
            cols = []
            for _ in range(6):
                col = array("Q")
                col.frombytes(data[at:at + 8 * count])
                at += 8 * count
                cols.append(col)
            text = data[at:at + blob_len].decode()
            at += blob_len
            ends = list(accumulate(cols[5]))
            # slices made and applied by map: no Python-level loop per key
            keys = list(map(text.__getitem__, map(slice, [0, *ends[:-1]], ends)))
            if ends and ends[-1] != len(text):
                return None
            if count:
                tenants.append(CheckpointTenant(name, keys, *cols[:5]))
        if at != len(data) - 8:
            return None
        return Checkpoint(next_seq, next_region, regions, tenants)
    except (struct.error, UnicodeDecodeError, IndexError, ValueError):
        return None
