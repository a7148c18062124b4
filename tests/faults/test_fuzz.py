"""Random and truncated frames close only the connection that sent them: the daemon
keeps serving everyone else, and a normal client works afterwards."""

from __future__ import annotations

import os
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.client_worker import Value, pattern
from support.itest_support import assert_idle

from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.protocol import PROTOCOL_VERSION, FrameDecoder, encode
from ems.protocol import messages as m

pytestmark = pytest.mark.integration

VALID_OPENINGS = [
    encode(m.Hello(None, False)),
    encode(m.Hello("team-x", False)),
    encode(m.Hello(None, False)) + encode(m.Reserve(1, ["k"], [64])),
    encode(m.Hello(None, False)) + encode(m.Acquire(1, ["k"], None)),
    encode(m.Hello(None, False)) + encode(m.Commit(1, [1, 2, 3])),
    encode(m.Hello(None, False)) + encode(m.Release([1, 2, 3])),
]


def exchange(path: str, data: bytes, half_close: bool) -> bytes:
    """Send ``data`` on a fresh connection and read what comes back (briefly)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.1)
    got = b""
    try:
        s.connect(path)
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            while len(got) < 1 << 16:
                chunk, _fds, _flags, _ = socket.recv_fds(s, 1 << 16, 4)
                for fd in _fds:
                    os.close(fd)
                if not chunk:
                    break
                got += chunk
        except (socket.timeout, ConnectionError, BrokenPipeError):
            pass
    finally:
        s.close()
    return got


def test_random_and_truncated_frames(server, client_env):
    client_env(server)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()  # a client connected all along must not notice anything
    option = CcKvOption()

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.one_of(
        st.binary(max_size=64),
        st.tuples(st.sampled_from(VALID_OPENINGS), st.data()).map(
            lambda t: t[0][:t[1].draw(st.integers(0, len(t[0])))]),
        st.tuples(st.sampled_from(VALID_OPENINGS), st.binary(max_size=32)).map(
            lambda t: t[0] + t[1]),
    ), st.booleans())
    def fuzz(data: bytes, half_close: bool) -> None:
        exchange(server.socket_path, data, half_close)

    fuzz()
    assert server.running
    keys = ["after-fuzz"]
    v = Value(4096, pattern(keys[0], 4096))
    assert cc.save(option, keys, [v.wrappers()]).success == 1
    out = Value(4096)
    assert cc.load(option, keys, [out.wrappers()]).success == 1
    assert out.bytes() == v.bytes()
    report = assert_idle(server)  # the fuzzers' reservations and pins were dropped
    assert report["tenants"]["(anonymous)"]["objects"] == 1
    assert report["server"]["connections"] == 2  # ours + the stats query


def test_version_mismatch_gets_a_clear_error_and_others_keep_working(cc, server):
    reply = exchange(server.socket_path, encode(m.Hello(None, False),
                                                version=PROTOCOL_VERSION + 1), False)
    # The error comes back in a frame of the daemon's own version, then it closes.
    d = FrameDecoder()
    d.feed(reply)
    (err,) = list(d)
    assert isinstance(err, m.Error) and err.rid == 0
    assert f"version {PROTOCOL_VERSION + 1} is not supported" in err.message
    assert "protocol version" in server.log()
    v = Value(4096, pattern("ok", 4096))
    assert cc.save(CcKvOption(), ["ok"], [v.wrappers()]).success == 1


def test_a_slow_handshake_does_not_block_others(cc, server):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(server.socket_path)
        s.sendall(encode(m.Hello(None, False))[:5])  # and never the rest
        v = Value(4096, pattern("ok2", 4096))
        assert cc.save(CcKvOption(), ["ok2"], [v.wrappers()]).success == 1
    finally:
        s.close()
