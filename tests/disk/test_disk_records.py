"""The record header and the checkpoint, property-tested: what is encoded decodes to
itself, and a flipped byte is rejected (never decoded into something else)."""

from __future__ import annotations

from array import array

import hypothesis.strategies as st
from hypothesis import given, settings

from ems.disk.records import (
    HEADER_BYTES,
    MAX_NAME_BYTES,
    Checkpoint,
    CheckpointRegion,
    CheckpointTenant,
    decode_checkpoint,
    encode_checkpoint,
    encode_header,
    parse_header,
    record_span,
    value_checksum,
)

names = st.text(min_size=0, max_size=40)


@given(tenant=names, key=names, seq=st.integers(0, 2**48 - 1), value=st.binary(max_size=5000))
def test_header_round_trip(tenant, key, seq, value):
    block = encode_header(tenant, key, seq, value)
    assert len(block) == HEADER_BYTES
    h = parse_header(block)
    assert h is not None
    assert (h.tenant, h.key, h.seq, h.value_len) == (tenant, key, seq, len(value))
    assert value_checksum(block[:h.meaningful], value) == h.value_xxh3
    assert record_span(len(value)) % 4096 == 0


@given(tenant=names, key=names, value=st.binary(min_size=1, max_size=3000), data=st.data())
def test_a_flipped_byte_is_caught(tenant, key, value, data):
    block = encode_header(tenant, key, 7, value)
    h = parse_header(block)
    assert h is not None
    where = data.draw(st.integers(0, h.meaningful + len(value) - 1))
    bit = 1 << data.draw(st.integers(0, 7))
    record = bytearray(bytes(block[:h.meaningful]) + value)
    record[where] ^= bit
    head, val = record[:h.meaningful], bytes(record[h.meaningful:])
    got = parse_header(head)
    # the header's CRC rejects a flip in the header; the value checksum one in the value
    assert got is None or value_checksum(head, val) != got.value_xxh3


def test_names_longer_than_the_header_block_are_refused():
    import pytest
    with pytest.raises(ValueError):
        encode_header("t", "k" * MAX_NAME_BYTES, 1, b"")
    assert parse_header(encode_header("t", "k" * (MAX_NAME_BYTES - 1), 1, b"")) is not None


def test_garbage_is_not_a_header():
    assert parse_header(bytes(HEADER_BYTES)) is None
    assert parse_header(b"EMSR" + bytes(100)) is None


tenants = st.lists(st.tuples(st.text(max_size=8), st.lists(
    st.tuples(st.text(max_size=12), st.integers(1, 2**20), st.integers(0, 2**20),
              st.integers(0, 2**40), st.integers(0, 2**48 - 1)), max_size=20,
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
            array("Q", [e[4] for e in entries])))
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
