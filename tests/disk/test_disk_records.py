"""The batch format and the checkpoint, property-tested: what is encoded decodes to
itself, and a flipped byte is rejected (never decoded into something else)."""

from __future__ import annotations

import struct
import tempfile
import zlib
from array import array
from pathlib import Path
from unittest import mock

import hypothesis.strategies as st
import pytest
import xxhash
from hypothesis import given, settings

from ems.disk import records, recovery
from ems.disk.io import LOCAL
from ems.disk.records import (
    ALIGN,
    BATCH_FIXED_BYTES,
    ENTRY_FIXED_BYTES,
    MAX_NAME_BYTES,
    BatchHead,
    Checkpoint,
    CheckpointRegion,
    CheckpointTenant,
    Entry,
    checksum,
    decode_checkpoint,
    encode_batch_head,
    encode_checkpoint,
    layout,
    parse_batch_fixed,
    parse_batch_head,
    record_checksum,
    record_span,
)
from ems.disk.settings import DiskSettings

names = st.text(min_size=0, max_size=40)
values = st.lists(st.one_of(st.binary(max_size=3000),
                            st.integers(1, 3).map(lambda n: bytes(range(256)) * 16 * n)),
                  min_size=1, max_size=6)


def _batch(tenant: str, keys: list[str], vals: list[bytes], seq: int = 1
           ) -> tuple[bytes, BatchHead]:
    """A batch's bytes as the store writes them, and the head it must parse to."""
    tb, kbs = tenant.encode(), [k.encode() for k in keys]
    shape = layout(tb, kbs, [len(v) for v in vals])
    entries = tuple(Entry(k, seq + i, len(v), record_checksum(tenant, k, seq + i, v), off)
                    for i, (k, v, off) in enumerate(zip(keys, vals, shape.offsets)))
    raw = bytearray(shape.span)
    head = encode_batch_head(tb, kbs, [e.seq for e in entries], [e.value_len for e in entries],
                             [e.xxh3 for e in entries], shape.offsets, shape.span)
    assert len(head) == shape.head_len
    raw[:len(head)] = head
    for v, off in zip(vals, shape.offsets):
        raw[off:off + len(v)] = v
    return bytes(raw), BatchHead.of(tenant, shape.span, shape.head_len, entries)


def _valid(raw: bytes, tenant: str) -> list[tuple[str, bytes]]:
    """What a scan of ``raw`` accepts: (key, value) of each record that checks."""
    h = parse_batch_head(raw, tenant)
    if h is None:
        return []
    return [(e.key, raw[e.offset:e.offset + e.value_len]) for e in h.entries
            if record_checksum(tenant, e.key, e.seq,
                               raw[e.offset:e.offset + e.value_len]) == e.xxh3]


@given(tenant=names, vals=values, data=st.data())
def test_batch_round_trip_and_layout(tenant, vals, data):
    keys = data.draw(st.lists(names, min_size=len(vals), max_size=len(vals)))
    raw, want = _batch(tenant, keys, vals)
    fixed = parse_batch_fixed(raw)
    assert (fixed.head_len, fixed.span) == (want.head_len, want.span)
    assert parse_batch_head(raw, tenant) == want
    assert parse_batch_head(raw, tenant + "x") is None  # another tenant's head
    assert want.span % ALIGN == 0
    at = want.head_len
    for e in want.entries:  # in order, never overlapping, aligned when the size allows
        assert e.offset >= at
        assert e.offset % (ALIGN if e.value_len % ALIGN == 0 else 8) == 0
        at = e.offset + e.value_len
    assert at <= want.span
    assert _valid(raw, tenant) == list(zip(keys, vals))


@pytest.mark.parametrize("lens", [[64] * 5, [64, 60, 68], [64, 68, 60, 64], [3, 1, 5]])
def test_keys_of_one_length_and_of_others_with_the_same_total(lens):
    """The entries after the first are read at once when their keys are as long as its
    key; keys of other lengths that add up to the same bytes are read one by one (and
    found as written, never misread as keys of the first's length)."""
    keys = [chr(ord("a") + i) * n for i, n in enumerate(lens)]
    vals = [bytes([i]) * (4096 if i % 2 else 100) for i in range(len(lens))]
    raw, want = _batch("t", keys, vals)
    assert parse_batch_head(raw, "t") == want
    assert _valid(raw, "t") == list(zip(keys, vals))


@given(tenant=names, vals=values, before=st.binary(max_size=300), after=st.binary(max_size=64),
       cut=st.integers(1, 64))
def test_a_head_parses_in_place_inside_a_larger_buffer(tenant, vals, before, after, cut):
    """A scan hands the parser its read buffer and an offset: the same head as the
    batch's own bytes, and None (never a head) when the buffer ends inside it."""
    keys = [f"k{i}" for i in range(len(vals))]
    raw, want = _batch(tenant, keys, vals)
    buf = memoryview(before + raw + after)
    fixed = parse_batch_fixed(buf, len(before))
    assert (fixed.head_len, fixed.span) == (want.head_len, want.span)
    assert parse_batch_head(buf, tenant, len(before)) == want
    short = buf[:len(before) + max(0, want.head_len - cut)]
    assert parse_batch_head(short, tenant, len(before)) is None


@given(tenant=names, vals=values, data=st.data())
def test_a_flipped_byte_is_caught(tenant, vals, data):
    keys = [f"k{i}" for i in range(len(vals))]
    raw, want = _batch(tenant, keys, vals)
    meaningful = list(range(want.head_len)) + [
        e.offset + i for e in want.entries for i in range(e.value_len)]
    where = data.draw(st.sampled_from(meaningful))
    bad = bytearray(raw)
    bad[where] ^= 1 << data.draw(st.integers(0, 7))
    got = _valid(bytes(bad), tenant)
    # the head's CRC rejects a flip in the head (the whole batch); a record's checksum
    # a flip in its value (that record alone)
    if where < want.head_len:
        assert got == []
    else:
        hit = next(e for e in want.entries if e.offset <= where < e.offset + e.value_len)
        assert got == [(k, v) for k, v in zip(keys, vals) if k != hit.key]


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.one_of(
    st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 40), st.integers(0, 9000)),
    st.integers(1, 3)), min_size=1, max_size=8),
    read=st.sampled_from([512, ALIGN, 3 * ALIGN]), window=st.sampled_from([64, ALIGN]))
def test_a_scan_finds_the_same_records_through_any_read_buffer(parts, read, window):
    """A region of tenant ``a``'s and ``b``'s batches (1-40 records of 0-9000 bytes) and
    blocks of garbage, scanned through read buffers and head windows smaller than its
    heads and values: every record of ``a`` is found, at its offset, and nothing else,
    as with the default buffer."""
    raw = bytearray()
    want = []
    seq = 1
    for part in parts:
        if isinstance(part, int):  # garbage: a block of a batch cut short or of noise
            raw += bytes([0x5A]) * (part * ALIGN)
            continue
        tenant, count, size = part
        keys = [f"{tenant}{seq + i}" for i in range(count)]
        vals = [bytes([i % 251]) * size for i in range(count)]
        batch, head = _batch(tenant, keys, vals, seq)
        if tenant == "a":
            want += [(e.key, len(raw) + e.offset, e.value_len, e.seq) for e in head.entries]
        raw += batch
        seq += count
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "r.region")
        Path(path).write_bytes(raw)
        whole = recovery.scan_region(LOCAL, path, "a", 0)
        with mock.patch.object(recovery, "SCAN_READ_BYTES", read), \
                mock.patch.object(recovery, "HEAD_WINDOW", window):
            small = recovery.scan_region(LOCAL, path, "a", 0)
    for got in (whole, small):
        assert list(zip(got.keys, got.offsets, got.sizes, got.seqs)) == want
        assert got.damaged == 0


@pytest.mark.parametrize("read", [512, 8 << 20])
def test_a_scan_drops_the_one_record_whose_value_was_flipped(read):
    """Records checked a head at a time (one call of ``checksums``; through a small
    read buffer, in pieces as the buffer moves on): a bit flipped in one value drops
    that record alone, counted damaged."""
    keys = [f"k{i}" for i in range(6)]
    vals = [bytes([i]) * (3000 + 700 * i) for i in range(6)]
    raw, head = _batch("a", keys, vals)
    bad = bytearray(raw)
    bad[head.entries[3].offset + 100] ^= 0x10
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "r.region")
        Path(path).write_bytes(bytes(bad))
        with mock.patch.object(recovery, "SCAN_READ_BYTES", read):
            got = recovery.scan_region(LOCAL, path, "a", 0)
    assert got.keys == [k for i, k in enumerate(keys) if i != 3] and got.damaged == 1


@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=40, deadline=None)
@given(tenant=names, recs=st.lists(st.tuples(names, st.integers(0, 2**63), st.binary(
    max_size=5000)), max_size=12))
def test_a_batch_of_checksums_is_each_record_s_checksum(native, tenant, recs):
    """``checksums`` (native where built, the xxhash package otherwise) gives every
    record's :func:`checksum`."""
    if native and records._batch_checksums is None:
        pytest.skip("ems._native was not built")
    tb = tenant.encode()
    kbs = [k.encode() for k, _, _ in recs]
    seqs = [seq for _, seq, _ in recs]
    views = [memoryview(v) for _, _, v in recs]
    want = [checksum(tb, kb, seq, v) for kb, seq, v in zip(kbs, seqs, views)]
    with mock.patch.object(records, "_batch_checksums",
                           records._batch_checksums if native else None):
        assert records.checksums(tb, kbs, seqs, views) == want


def test_the_native_checksums_refuse_what_they_cannot_hash():
    fn = records._batch_checksums
    if fn is None:
        pytest.skip("ems._native was not built")
    for args, error in [((b"t", ["k"], [1], [b"v"]), TypeError),
                        ((b"t", [b"k"], [-1], [b"v"]), OverflowError),
                        ((b"t", [b"k"], [1, 2], [b"v"]), ValueError),
                        (("t", [b"k"], [1], [b"v"]), TypeError),
                        ((b"t", [b"k" * 70000], [1], [b"v"]), TypeError)]:
        with pytest.raises(error):
            fn(*args)


#: the fields of a head a forgery changes: (struct format, offset in the fixed part, or
#: in an entry when the name starts with "entry")
_FIELDS = {"magic": ("<I", 0), "version": ("<H", 4), "flags": ("<H", 6), "count": ("<I", 12),
           "head_len": ("<I", 16), "span": ("<Q", 20), "tl": ("<H", 28),
           "entry.offset": ("<I", 0), "entry.seq": ("<Q", 4), "entry.vlen": ("<Q", 12),
           "entry.kl": ("<H", 28)}


def _forged(raw: bytes, head: BatchHead, forge: list[tuple[str, int, int]]) -> bytes:
    """``raw`` (a batch of ``head``) with fields changed and the head's CRC made to
    match again: a head whose fields, not its CRC, are wrong (as a bug could write
    one). ``forge``: (field, entry index, change); "byte" sets a byte of the head,
    "key" a byte of an entry's key (to a byte the change picks: UTF-8 or not)."""
    bad = bytearray(raw)
    tl = len(head.tenant.encode())
    for name, i, change in forge:
        i %= len(head.keys)
        entry = 30 + tl + sum(30 + len(k.encode()) for k in head.keys[:i])
        if name == "byte":
            bad[i * 97 % head.head_len] = change % 256
        elif name == "key":
            kl = len(head.keys[i].encode())
            if kl:
                bad[entry + 30 + change % kl] = (0x80, 0xC3, 0xED, 0xFF)[change % 4]
        else:
            fmt, at = _FIELDS[name]
            at += entry if name.startswith("entry") else 0
            was = struct.unpack_from(fmt, bad, at)[0]
            # (an even change moves a span, an offset or a length by whole blocks)
            scale = (ALIGN if change % 2 == 0 and name in ("span", "entry.vlen") else
                     8 if name == "entry.offset" else 1)
            struct.pack_into(fmt, bad, at, max(0, was + change * scale)
                             % (1 << 8 * struct.calcsize(fmt)))
    head_len = struct.unpack_from("<I", bad, 16)[0]
    bad[8:12] = b"\0" * 4
    struct.pack_into("<I", bad, 8, zlib.crc32(bytes(bad[:min(head_len, len(bad))])))
    return bytes(bad)


def _both_steps(raw: bytes, tenant: str, read: int = recovery.SCAN_READ_BYTES,
                window: int = recovery.HEAD_WINDOW) -> list[recovery.Scanned]:
    """``raw`` scanned for ``tenant`` with the native step and without it, through read
    buffers of ``read`` bytes and head windows of ``window``."""
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "r.region")
        Path(path).write_bytes(raw)
        got = []
        for native in (recovery._scan_batches, None):
            with mock.patch.object(recovery, "_scan_batches", native), \
                    mock.patch.object(recovery, "SCAN_READ_BYTES", read), \
                    mock.patch.object(recovery, "HEAD_WINDOW", window):
                got.append(recovery.scan_region(LOCAL, path, tenant, 0))
    return got


@pytest.mark.skipif(recovery._scan_batches is None, reason="ems._native was not built")
@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.one_of(
    st.tuples(st.sampled_from(["a", "b", "ä"]),
              st.lists(st.tuples(st.text(max_size=6), st.integers(0, 9000)), min_size=1,
                       max_size=6),
              st.lists(st.tuples(st.sampled_from(["byte", "key", *_FIELDS]),
                                 st.integers(0, 5), st.integers(-3, 3)), max_size=2),
              st.booleans()),
    st.integers(1, 2)), min_size=1, max_size=6),
    read=st.sampled_from([512, 3 * ALIGN, 8 << 20]), window=st.sampled_from([64, ALIGN]))
def test_the_native_scan_step_takes_what_the_python_step_takes(parts, read, window):
    """``ems._native.scan_batches`` (the scan's step over the whole batches of its
    buffer) against the Python step (:func:`parse_batch_head`, a head at a time):
    batches of tenants ``a``, ``b`` and ``ä``, some with head fields forged under a
    matching CRC (counts, lengths, offsets, names, keys not UTF-8), some with a value
    flipped, and garbage, through read buffers and head windows of any size: the same
    records, offsets, sizes, seqs, checksums and damaged count."""
    raw = bytearray()
    seq = 1
    for part in parts:
        if isinstance(part, int):
            raw += bytes([0x5A]) * (part * ALIGN)
            continue
        tenant, recs, forge, flip = part
        keys = [f"{k}{seq + i}" for i, (k, _) in enumerate(recs)]
        vals = [bytes([(seq + i) % 251]) * n for i, (_, n) in enumerate(recs)]
        batch, head = _batch(tenant, keys, vals, seq)
        if forge:
            batch = _forged(batch, head, forge)
        if flip and head.value_lens[-1]:
            bad = bytearray(batch)
            bad[head.offsets[-1]] ^= 1
            batch = bytes(bad)
        raw += batch
        seq += len(recs)
    for tenant in ("a", "ä"):
        native, python = _both_steps(bytes(raw), tenant, read, window)
        assert native == python


@pytest.mark.skipif(recovery._scan_batches is None, reason="ems._native was not built")
def test_every_forged_field_is_judged_alike_by_both_steps():
    """Each field of a head of three records (and a key byte, and a byte anywhere in
    the head) changed by -3..3 under a matching CRC, a valid batch after it: the
    native step takes what the Python step takes, and the same records of the next
    batch."""
    keys, vals = ["k1", "kk2", "k3"], [b"x" * 100, b"y" * 4096, b"z" * 300]
    batch, head = _batch("a", keys, vals)
    after, _ = _batch("a", ["n1"], [b"n" * 50], 9)
    for name in ["byte", "key", *_FIELDS]:
        for i in range(len(keys)):
            for change in range(-3, 4):
                raw = _forged(batch, head, [(name, i, change)]) + after
                native, python = _both_steps(raw, "a")
                assert native == python, (name, i, change)


@pytest.mark.skipif(recovery._scan_batches is None, reason="ems._native was not built")
@pytest.mark.parametrize("tenant", ["a", "ä"])
def test_the_native_scan_step_keeps_the_name_limit(tenant):
    """Heads whose tenant + key are :data:`MAX_NAME_BYTES` long, and one byte longer
    (only a hand-made head has one: ``layout`` refuses it): the first taken, the
    second not, by both steps."""
    tb = tenant.encode()
    raw = bytearray()
    for extra, seq in ((0, 1), (1, 2)):
        kb = b"k" * (MAX_NAME_BYTES - len(tb) + extra)
        value = bytes([seq]) * 100
        head_len = BATCH_FIXED_BYTES + len(tb) + ENTRY_FIXED_BYTES + len(kb)
        off = -(-head_len // 8) * 8
        span = -(-(off + len(value)) // ALIGN) * ALIGN
        xxh = checksum(tb, kb, seq, value)
        batch = bytearray(span)
        head = encode_batch_head(tb, [kb], [seq], [len(value)], [xxh], [off], span)
        batch[:len(head)] = head
        batch[off:off + len(value)] = value
        raw += batch
    native, python = _both_steps(bytes(raw), tenant)
    assert native == python and native.seqs == [1]


def test_the_native_scan_step_refuses_what_it_cannot_scan():
    fn = recovery._scan_batches
    if fn is None:
        pytest.skip("ems._native was not built")
    cols: list[list] = [[], [], [], [], []]
    for args, error in [((b"", 0, 64, "t", 0, *cols), TypeError),
                        ((b"", 0, 64, b"t", 0, *cols[:4], ()), TypeError),
                        ((b"", -1, 64, b"t", 0, *cols), ValueError),
                        ((b"", 0, 8, b"t", 0, *cols), ValueError),
                        ((b"", 0, 64, b"t" * 70000, 0, *cols), ValueError),
                        ((b"", 0, 64, b"t", -1, *cols), OverflowError)]:
        with pytest.raises(error):
            fn(*args)
    assert fn(b"", 0, 64, b"t", 0, *cols) == (0, 0) and cols == [[], [], [], [], []]


@given(tenant=names, key=names, seq=st.integers(0, 2**48 - 1), value=st.binary(max_size=600))
def test_the_checksum_binds_the_identity(tenant, key, seq, value):
    x = record_checksum(tenant, key, seq, value)
    assert checksum(tenant.encode(), key.encode(), seq, value) == x  # the one algorithm
    assert record_checksum(tenant, key, seq + 1, value) != x
    assert record_checksum(tenant, key + "x", seq, value) != x
    assert record_checksum(tenant + "x", key, seq, value) != x
    assert record_checksum(tenant, key, seq, value + b"\0") != x


def test_names_longer_than_a_head_block_are_refused():
    with pytest.raises(ValueError):
        layout(b"t", [b"k" * MAX_NAME_BYTES], [0])
    raw, _ = _batch("t", ["k" * (MAX_NAME_BYTES - 1)], [b"v"])
    assert parse_batch_head(raw, "t") is not None
    assert len(raw) <= record_span(1)  # the bound capacity planning uses


def test_the_heads_of_a_full_write_buffer_of_16_kib_values_are_under_1_percent():
    n = DiskSettings.write_buffer_bytes // (16 << 10)  # (the default's records)
    keys = [f"{i:064x}" for i in range(n)]  # V1-like hashes
    shape = layout(b"tenant", [k.encode() for k in keys], [16 << 10] * len(keys))
    values_bytes = n * (16 << 10)
    assert (shape.span - values_bytes) / shape.span < 0.01


def test_garbage_and_the_old_format_are_not_a_batch():
    assert parse_batch_fixed(bytes(ALIGN)) is None
    assert parse_batch_head(b"EMSB" + bytes(100), "") is None
    # ems 0.1's record header (format 1): magic EMSR, version 1, a 4 KiB block
    old = bytearray(ALIGN)
    struct.pack_into("<4sHHIQQQHHI", old, 0, b"EMSR", 1, 0, 0, 1, 5, 0, 1, 1, 0)
    assert parse_batch_fixed(old) is None and parse_batch_head(old, "t") is None
    raw, _ = _batch("t", ["k"], [b"v" * 10])
    newer = bytearray(raw)
    newer[4] = 3  # a later version: refused, not guessed at
    assert parse_batch_fixed(newer) is None and parse_batch_head(newer, "t") is None


tenants = st.lists(st.tuples(st.text(max_size=8), st.lists(
    st.tuples(st.text(max_size=12), st.integers(1, 2**20), st.integers(0, 2**20),
              st.integers(0, 2**40), st.integers(0, 2**48 - 1), st.integers(0, 2**64 - 1)),
    max_size=20,
    unique_by=lambda e: e[0])), max_size=4, unique_by=lambda t: t[0])


def _checkpoint(ts, next_seq, next_region) -> Checkpoint:
    out = []
    regions = []
    for name, entries in sorted(ts):  # the file keeps tenants sorted by name
        if not entries:
            continue
        out.append(CheckpointTenant(
            name, [e[0] for e in entries], array("Q", [e[1] for e in entries]),
            array("Q", [e[2] * 4096 for e in entries]), array("Q", [e[3] for e in entries]),
            array("Q", [e[4] for e in entries]), array("Q", [e[5] for e in entries])))
        regions += [CheckpointRegion(name, r, 4096) for r in sorted({e[1] for e in entries})]
    return Checkpoint(next_seq, next_region, regions, out)


@settings(max_examples=60)
@given(ts=tenants, next_seq=st.integers(0, 2**60), next_region=st.integers(0, 2**40))
def test_checkpoint_round_trip(ts, next_seq, next_region):
    ck = _checkpoint(ts, next_seq, next_region)
    assert decode_checkpoint(encode_checkpoint(ck)) == ck


@settings(max_examples=60)
@given(ts=tenants, data=st.data())
def test_a_damaged_checkpoint_is_rejected(ts, data):
    raw = bytearray(encode_checkpoint(_checkpoint(ts, 5, 9)))
    where = data.draw(st.integers(0, len(raw) - 1))
    raw[where] ^= 1 << data.draw(st.integers(0, 7))
    assert decode_checkpoint(bytes(raw)) is None
    assert decode_checkpoint(bytes(raw[:where])) is None


def test_a_version_1_checkpoint_is_refused():
    raw = bytearray(encode_checkpoint(_checkpoint([], 5, 9)))
    raw[:8] = b"EMSCKPT1"  # ems 0.1's, its trailer right: refused by its magic alone
    struct.pack_into("<Q", raw, len(raw) - 8, xxhash.xxh3_64_intdigest(bytes(raw[:-8])))
    assert decode_checkpoint(bytes(raw)) is None


@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=40, deadline=None)
@given(tenant=names, vals=values, first=st.integers(0, 2**40), data=st.data())
def test_encode_batch_is_the_head_and_the_checksums(native, tenant, vals, first, data):
    """``encode_batch`` (one native call where built) gives the bytes of
    ``encode_batch_head`` and the checksums of ``checksums``, for any batch."""
    if native and records._native_encode_batch is None:
        pytest.skip("ems._native was not built")
    tb = tenant.encode()
    kbs = [k.encode() for k in data.draw(st.lists(names, min_size=len(vals),
                                                  max_size=len(vals)))]
    views = [memoryview(v) for v in vals]
    shape = layout(tb, kbs, [len(v) for v in vals])
    seqs = list(range(first, first + len(vals)))
    sums = [checksum(tb, kb, seq, v) for kb, seq, v in zip(kbs, seqs, views)]
    want = encode_batch_head(tb, kbs, seqs, [len(v) for v in vals], sums, shape.offsets,
                             shape.span)
    with mock.patch.object(records, "_native_encode_batch",
                           records._native_encode_batch if native else None):
        head, got = records.encode_batch(tb, kbs, first, views, list(shape.offsets),
                                         shape.span)
    assert bytes(head) == bytes(want) and got == sums
    raw = bytearray(shape.span)
    raw[:len(head)] = head
    for v, off in zip(vals, shape.offsets):
        raw[off:off + len(v)] = v
    assert _valid(bytes(raw), tenant) == [(k.decode(), v) for k, v in zip(kbs, vals)]


def test_the_native_encode_batch_refuses_what_it_cannot_encode():
    fn = records._native_encode_batch
    if fn is None:
        pytest.skip("ems._native was not built")
    for args, error in [((b"t", ["k"], 1, [b"v"], [4096], 8192), TypeError),
                        ((b"t", [b"k"], -1, [b"v"], [4096], 8192), OverflowError),
                        ((b"t", [b"k"], 1, [b"v", b"w"], [4096], 8192), ValueError),
                        ((b"t", [], 1, [], [], 8192), ValueError),
                        ((b"t", [b"k"], 1, [b"v"], [2**32], 2**33), ValueError),
                        ((b"t", [b"k"], 1, [b"v"], (4096,), 8192), TypeError),
                        ((b"t", [b"k" * 70000], 1, [b"v"], [4096], 8192), TypeError)]:
        with pytest.raises(error):
            fn(*args)
