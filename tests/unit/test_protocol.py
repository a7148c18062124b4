"""The sans-I/O protocol: every message round-trips, any split of the byte stream
decodes the same, and every kind of malformed input is a clean EMS_PROTOCOL_ERROR."""

from __future__ import annotations

import dataclasses
import struct
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ems.errors import EmsErrorCode, EmsException
from ems.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameDecoder,
    encode,
    encode_wire,
)
from ems.protocol import messages as m
from ems.protocol.framing import DecodeLimitExceeded
from ems.protocol.messages import auth_mac

u64 = st.integers(0, (1 << 64) - 1)
rid = st.integers(1, (1 << 64) - 1)
text = st.text(max_size=40)
uints = st.lists(u64, max_size=8)


def _tree() -> st.SearchStrategy:
    leaf = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | \
        st.floats(allow_nan=False) | text
    return st.recursive(leaf, lambda c: st.lists(c, max_size=4) |
                        st.dictionaries(text, c, max_size=4), max_leaves=12)


def _parallel(n_lists: int) -> st.SearchStrategy:
    return st.integers(0, 6).flatmap(
        lambda n: st.tuples(*[st.lists(u64, min_size=n, max_size=n) for _ in range(n_lists)]))


def _keys_sizes(optional: bool) -> st.SearchStrategy:
    def build(n: int) -> st.SearchStrategy:
        sizes = st.lists(u64, min_size=n, max_size=n)
        return st.tuples(st.lists(text, min_size=n, max_size=n),
                         st.none() | sizes if optional else sizes)
    return st.integers(0, 6).flatmap(build)


MESSAGE_STRATEGIES: dict[type, st.SearchStrategy] = {
    m.Hello: st.builds(m.Hello, st.none() | text, st.booleans()),
    m.Challenge: st.builds(m.Challenge, st.binary(max_size=64)),
    m.Auth: st.builds(m.Auth, st.binary(max_size=64)),
    m.Welcome: st.builds(m.Welcome, text, u64, u64,
                         st.floats(0, 1e6) | st.integers(0, 10**6), text, u64,
                         st.sampled_from([1, 64, 4096]), u64),
    # (hashes: None, or one u64 per key: the sizes list reused, it has the length)
    m.Reserve: st.builds(lambda r, ks, h, o: m.Reserve(r, *ks, hashes=ks[1] if h else None,
                                                        write_out=o),
                         rid, _keys_sizes(False), st.booleans(), st.booleans()),
    m.Commit: st.builds(m.Commit, rid, uints),
    m.Abort: st.builds(m.Abort, uints),
    m.Acquire: st.builds(lambda r, ks: m.Acquire(r, *ks), rid, _keys_sizes(True)),
    m.Release: st.builds(m.Release, uints),
    m.Exists: st.builds(lambda r, ks: m.Exists(r, *ks), rid, _keys_sizes(True)),
    m.Stats: st.builds(m.Stats, rid, st.booleans()),
    m.Ping: st.builds(m.Ping, rid),
    m.Lease: st.builds(m.Lease, rid),
    m.Put: st.builds(lambda r, ks, w, h, o: m.Put(r, ks[0], ks[1][0], ks[1][1], w,
                                                  hashes=ks[1][1] if h else None,
                                                  write_out=o), rid,
                     st.integers(0, 6).flatmap(lambda n: st.tuples(
                         st.lists(text, min_size=n, max_size=n),
                         st.tuples(st.lists(u64, min_size=n, max_size=n),
                                   st.lists(u64, min_size=n, max_size=n)))),
                     st.booleans(), st.booleans(), st.booleans()),
    m.Return: st.builds(lambda ls: m.Return(*ls), _parallel(2)),
    m.Leased: st.builds(m.Leased, rid, u64, u64),
    m.Stored: st.builds(m.Stored, rid, st.lists(st.booleans(), max_size=8), u64, u64),
    m.Granted: st.builds(lambda r, ls: m.Granted(r, *ls), rid, _parallel(4)),
    m.Committed: st.builds(m.Committed, rid, st.lists(st.booleans(), max_size=8)),
    m.Pinned: st.builds(lambda r, ls: m.Pinned(r, *ls), rid, _parallel(3)),
    m.Count: st.builds(m.Count, rid, u64),
    m.StatsReply: st.builds(m.StatsReply, rid, st.dictionaries(text, _tree(), max_size=4)),
    m.Pong: st.builds(m.Pong, rid),
    m.Error: st.builds(m.Error, u64, u64, text),
}
any_message = st.one_of(list(MESSAGE_STRATEGIES.values()))


def decode_all(data: bytes) -> list[m.Message]:
    d = FrameDecoder()
    d.feed(data)
    return list(d)


def frame(body: bytes, version: int = PROTOCOL_VERSION, flags: int = 0,
          magic: bytes = b"EM") -> bytes:
    return HEADER.pack(magic, version, flags, len(body)) + body


def assert_protocol_error(data: bytes, match: str = "") -> None:
    with pytest.raises(EmsException, match=match) as info:
        decode_all(data)
    assert info.value.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGE_STRATEGIES) == set(m.MESSAGES.values())
    assert len({cls.TYPE for cls in m.MESSAGES.values()}) == len(m.MESSAGES)


@given(any_message)
def test_round_trip(msg: m.Message) -> None:
    assert decode_all(encode(msg)) == [msg]


@given(st.lists(any_message, min_size=1, max_size=5), st.data())
def test_any_split_of_the_stream_decodes_the_same(msgs: list, data: st.DataObject) -> None:
    stream = b"".join(encode(x) for x in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    d = FrameDecoder()
    out = []
    prev = 0
    for cut in cuts + [len(stream)]:
        d.feed(stream[prev:cut])
        prev = cut
        out.extend(d)
    assert out == msgs
    assert d.buffered == 0


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_protocol_errors(junk: bytes) -> None:
    d = FrameDecoder()
    d.feed(junk)
    try:
        list(d)
    except EmsException as exc:
        assert exc.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR


@given(any_message, st.data())
def test_truncated_frames_wait_for_more(msg: m.Message, data: st.DataObject) -> None:
    raw = encode(msg)
    cut = data.draw(st.integers(0, len(raw) - 1))
    d = FrameDecoder()
    d.feed(raw[:cut])
    assert d.next_message() is None


wire_int = st.integers(-(1 << 63), (1 << 64) - 1)  # what msgpack can carry


@given(st.lists(st.one_of(st.none(), st.booleans(), wire_int, st.text(max_size=5),
                          st.binary(max_size=5), st.lists(wire_int, max_size=3)),
                max_size=6), st.sampled_from(sorted(m.MESSAGES)))
def test_wrong_field_types_are_protocol_errors(fields: list, code: int) -> None:
    body = msgpack.packb([code, *fields], use_bin_type=True)
    try:
        msg = decode_all(frame(body))
    except EmsException as exc:
        assert exc.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR
    else:  # the random fields happened to be valid: then they must round-trip
        assert decode_all(encode(msg[0])) == msg


def test_write_out_is_a_trailing_option_old_peers_keep_working() -> None:
    """An old client's Reserve/Put (no ``write_out``) means write out, as before; a new
    client leaves the field off unless it is False, so an old daemon takes its
    default requests (the field count it knows); False travels and is checked."""
    old_reserve = encode_wire([m.Reserve.TYPE, 1, ["k"], [64], True, None])
    assert decode_all(old_reserve) == [m.Reserve(1, ["k"], [64])]
    assert decode_all(old_reserve)[0].write_out is True
    old_put = [m.Put.TYPE, 1, ["k"], [0], [64], False, True, 0, None]
    assert decode_all(encode_wire(old_put))[0].write_out is True
    new = m.Put.wire(rid=1, keys=["k"], offsets=[0], sizes=[64], want_lease=False,
                     write_out=True)
    assert m.trimmed(new, 1) == old_put  # what a daemon from before the field takes
    skip = m.trimmed(m.Reserve.wire(rid=2, keys=["k"], sizes=[64], write_out=False), 2)
    assert skip[-1] is False  # (budget_ms 0 left off, write_out False kept)
    assert decode_all(encode_wire(skip)) == [m.Reserve(2, ["k"], [64], write_out=False)]
    with pytest.raises(EmsException) as info:
        decode_all(encode_wire([m.Reserve.TYPE, 1, ["k"], [64], True, None, 1]))
    assert info.value.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR
    assert "Reserve.write_out" in info.value.message()


def test_a_reserves_budget_travels_after_write_out_and_is_left_off_at_zero() -> None:
    """``budget_ms`` (what is left of the save's deadline) follows ``write_out``: a
    Reserve without a deadline is sent as a daemon from before both fields reads it; with
    one, both travel (``write_out`` True among them) and are checked."""
    plain = m.trimmed(m.Reserve.wire(rid=3, keys=["k"], sizes=[64]), 2)
    assert plain == [m.Reserve.TYPE, 3, ["k"], [64], True, None]
    timed = m.trimmed(m.Reserve.wire(rid=4, keys=["k"], sizes=[64], budget_ms=250), 2)
    assert timed == [m.Reserve.TYPE, 4, ["k"], [64], True, None, True, 250]
    assert decode_all(encode_wire(timed)) == [m.Reserve(4, ["k"], [64], budget_ms=250)]
    only_out = m.trimmed(m.Reserve.wire(rid=5, keys=["k"], sizes=[64], write_out=False,
                                        budget_ms=0), 2)
    assert only_out == [m.Reserve.TYPE, 5, ["k"], [64], True, None, False]
    # a field older than the newer ones is never left off, even at its default
    assert m.trimmed(m.Reserve.wire(rid=6, keys=["k"], sizes=[64]), 0)[-1] == 0
    with pytest.raises(EmsException) as info:
        decode_all(encode_wire([m.Reserve.TYPE, 1, ["k"], [64], True, None, True, -1]))
    assert info.value.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR
    assert "Reserve.budget_ms" in info.value.message()


def test_version_mismatch_names_both_versions() -> None:
    data = encode(m.Ping(1), version=PROTOCOL_VERSION + 1)
    assert_protocol_error(data, match=f"version {PROTOCOL_VERSION + 1} is not supported")


def test_bad_magic_flags_and_oversized_frames() -> None:
    assert_protocol_error(b"GET / HTTP/1.1\r\n", match="bad magic")
    assert_protocol_error(b"X", match="bad magic")
    assert_protocol_error(frame(msgpack.packb([17, 1]), flags=1), match="flags")
    header = HEADER.pack(b"EM", PROTOCOL_VERSION, 0, MAX_FRAME_BYTES + 1)
    assert_protocol_error(header, match="exceeds")


def test_malformed_bodies() -> None:
    assert_protocol_error(frame(b"\xc1"), match="malformed")           # never-used byte
    assert_protocol_error(frame(msgpack.packb([17, 1]) + b"\x00"), match="malformed")
    assert_protocol_error(frame(msgpack.packb({"a": 1})), match="array")
    assert_protocol_error(frame(msgpack.packb([99, 1])), match="unknown message type")
    assert_protocol_error(frame(msgpack.packb([17, 0])), match="Ping.rid")  # rid 0
    assert_protocol_error(frame(msgpack.packb([10, 1, ["a", "b"], [1]])), match="equal")
    assert_protocol_error(frame(msgpack.packb([17, 1, 2])), match="fields")


@pytest.mark.parametrize("name, body", [
    ("max_array_len", [0] * 9), ("max_str_len", "s" * 9), ("max_bin_len", b"b" * 9),
    ("max_map_len", {str(i): i for i in range(9)}),
    ("max_ext_len", msgpack.ExtType(1, b"e" * 9))])
def test_a_body_past_an_unpack_limit_is_its_own_protocol_error(name, body) -> None:
    """Each of msgpack's bounds raises DecodeLimitExceeded (the daemon's decode_limits
    counter), by the wording framing reads; junk that msgpack also answers with a plain
    ValueError (a truncated body, an int map key) stays a plain protocol error."""
    limits = dict.fromkeys(("max_array_len", "max_str_len", "max_bin_len", "max_map_len",
                            "max_ext_len"), 100)
    limits[name] = 8
    for both in (False, True):  # the daemon's five explicit keywords, or a ** dict
        d = FrameDecoder()
        d.unpack_limits = limits if both else {name: 8}
        with pytest.raises(DecodeLimitExceeded) as info:
            d.bodies(frame(msgpack.packb([17, body])))
        assert info.value.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR
        assert name in info.value.message()
    for junk in (msgpack.packb([17, 1])[:-1], msgpack.packb({1: 2})):
        d = FrameDecoder()
        d.unpack_limits = limits
        with pytest.raises(EmsException) as plain:
            d.bodies(frame(junk))
        assert type(plain.value) is EmsException


def test_a_failed_decoder_stays_failed() -> None:
    d = FrameDecoder()
    d.feed(b"junk!!!!!")
    with pytest.raises(EmsException):
        d.next_message()
    d.feed(encode(m.Ping(1)))
    with pytest.raises(EmsException):
        d.next_message()


def test_header_layout_is_stable() -> None:
    raw = encode(m.Ping(7))
    magic, version, flags, length = struct.unpack(">2sBBI", raw[:8])
    assert (magic, version, flags, length) == (b"EM", PROTOCOL_VERSION, 0, len(raw) - 8)


def test_error_rebuilds_the_exception() -> None:
    exc = m.Error(3, EmsErrorCode.EMS_AUTH_FAILED.value, "nope").exception()
    assert exc.status_code() is EmsErrorCode.EMS_AUTH_FAILED and exc.message() == "nope"
    assert m.Error(0, 999, "?").exception().status_code() is EmsErrorCode.EMS_INTERNAL_ERROR


def test_auth_mac_depends_on_key_nonce_and_id() -> None:
    key = "K" * 32
    base = auth_mac(key, b"n" * 32, "team-a")
    assert len(base) == 32
    assert base == auth_mac(key, b"n" * 32, "team-a")
    assert base != auth_mac("L" * 32, b"n" * 32, "team-a")
    assert base != auth_mac(key, b"m" * 32, "team-a")
    assert base != auth_mac(key, b"n" * 32, "team-b")


def test_messages_are_frozen_dataclasses() -> None:
    for cls in m.MESSAGES.values():
        assert dataclasses.is_dataclass(cls)
        params = cls.__dataclass_params__
        assert params.frozen, cls
        hints = typing.get_type_hints(cls)
        assert "TYPE" in hints or hasattr(cls, "TYPE")


# ---------------------------------------------------------------- bodies()

def test_bodies_of_one_whole_frame_and_of_any_split():
    frames = [encode(m.Ping(1)), encode(m.Put(2, ["k"], [64], [4096], True)),
              encode(m.Pong(3))]
    dec = FrameDecoder()
    assert dec.bodies(frames[0]) == [[m.Ping.TYPE, 1]]
    assert dec.buffered == 0
    stream = b"".join(frames)
    for cut in range(len(stream) + 1):
        dec = FrameDecoder()
        got = dec.bodies(stream[:cut]) + dec.bodies(stream[cut:])
        assert [m.from_wire(b) for b in got] == [m.Ping(1), m.Put(2, ["k"], [64], [4096], True),
                                                 m.Pong(3)]
        assert dec.buffered == 0 and dec.failed is None


def test_bodies_return_the_good_frames_before_a_corrupt_one():
    bad = HEADER.pack(b"EM", PROTOCOL_VERSION, 0, 2) + b"\xc1\xc1"  # 0xc1: never used
    dec = FrameDecoder()
    assert dec.bodies(encode(m.Ping(1)) + bad) == [[m.Ping.TYPE, 1]]
    assert dec.failed is not None
    with pytest.raises(EmsException) as info:
        dec.bodies(encode(m.Ping(2)))
    assert info.value.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR
    dec = FrameDecoder()  # a corrupt frame alone raises at once
    with pytest.raises(EmsException):
        dec.bodies(bad)
    assert dec.failed is not None
