"""The pure parts of ems.cluster: keys and slots, URL parsing, the value header, RESP."""

from __future__ import annotations

import socket
import threading

import pytest

from ems.cluster import keys as ck
from ems.cluster.resp import ErrorReply, Reader, RespError, command, send_parts, set_parts
from ems.cluster.topology import parse_url
from ems.errors import EmsErrorCode, EmsException
from ems.keys import PrimaryKey, v0_storage_keys


def test_crc16_is_xmodem_and_slots_follow_hash_tags():
    assert ck.crc16(b"123456789") == 0x31C3  # the XMODEM check value
    assert ck.hash_slot(b"foo{bar}zap") == ck.hash_slot(b"bar")
    assert ck.hash_slot(b"{}bar") == ck.crc16(b"{}bar") % 16384  # empty tag: the whole key
    assert ck.hash_slot(b"foo{{bar}}") == ck.hash_slot(b"{bar")


def test_the_hash_tag_is_exactly_tenant_and_distribute_key():
    a, b = v0_storage_keys([PrimaryKey("doc{1}", "x"), PrimaryKey("doc{1}", "y:}{")])
    ka, kb = ck.cluster_key("t", a), ck.cluster_key("t", b)
    assert ka == b"ems:{t/doc%7B1%7D}:x"
    assert ck.hash_slot(ka) == ck.hash_slot(kb) == ck.crc16(b"t/doc%7B1%7D") % 16384
    (plain,) = v0_storage_keys(["doc"])
    assert ck.cluster_key("t", plain) == b"ems:{t/doc}:"  # a str key is its own distribute key
    # The tenant's "/" and V0 ":" are escaped: no two (tenant, key) share a name.
    assert ck.cluster_key("a/b", plain) != ck.cluster_key("a", v0_storage_keys(["b/doc"])[0])
    (colon,) = v0_storage_keys(["v1:abc:5"])
    assert ck.cluster_key("t", colon) != ck.cluster_key("t", "v1:abc:5")
    assert ck.cluster_key("t", "v1:abc:5") == b"ems:{t/v1:abc:5}:"


def test_parse_url_reads_seeds_credentials_and_tls():
    s = parse_url("valkey://127.0.0.1:7000,127.0.0.1:7001")
    assert s.seeds == (("127.0.0.1", 7000), ("127.0.0.1", 7001)) and not s.tls
    s = parse_url("valkeys://user:p%40ss@h:1")
    assert (s.username, s.password, s.tls, s.seeds) == ("user", "p@ss", True, (("h", 1),))
    assert "p@ss" not in repr(s)
    for bad in ("127.0.0.1:7000", "http://h:1", "valkey://h", "valkey://h:0", "valkey://h:x"):
        with pytest.raises(EmsException) as info:
            parse_url(bad)
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT


def test_value_header_refuses_other_size_key_and_format():
    value = pytest.importorskip("ems.cluster.value")
    pytest.importorskip("xxhash")
    payload = bytes(range(256)) * 4
    head = value.header(b"k", payload)
    assert len(head) == value.HEADER == 32
    assert value.check_header(head, b"k", len(payload)) == value.digest(payload)
    assert value.check_header(head, b"other", len(payload)) is None  # foreign
    assert value.check_header(head, b"k", len(payload) - 1) is None  # other size
    assert value.check_header(b"XXXX" + head[4:], b"k", len(payload)) is None
    assert value.check_header(head[:31], b"k", len(payload)) is None  # short


def _serve(data: bytes):
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: (a.sendall(data), a.close()))
    t.start()
    return b, t


def test_reader_parses_replies_and_reads_bulk_into_given_memory():
    body = bytes(range(200)) * 1000
    data = (b"+OK\r\n-MOVED 12 127.0.0.1:7002\r\n:42\r\n$-1\r\n*2\r\n$1\r\na\r\n:1\r\n"
            + b"$%d\r\n" % len(body) + body + b"\r\n")
    sock, t = _serve(data)
    r = Reader(sock, size=4096)  # smaller than the value: most of it goes straight in
    assert r.reply() == "OK"
    err = r.reply()
    assert isinstance(err, ErrorReply) and err.startswith("MOVED")
    assert r.reply() == 42 and r.reply() is None and r.reply() == [b"a", 1]
    n, other = r.head()
    assert n == len(body) and other is None
    target = bytearray(n)
    r.read_into(memoryview(target))
    r.crlf()
    assert bytes(target) == body
    t.join()
    sock.close()


class _CountingSocket:
    """A socket that records each recv_into: into the reader's own buffer or not, and
    how many bytes it took."""

    def __init__(self, sock):
        self.sock, self.reads, self.buffer = sock, [], None

    def recv_into(self, view, nbytes=0):
        n = self.sock.recv_into(view, nbytes)
        self.reads.append((view.obj is self.buffer, len(view), n))
        return n


def _read_values(fill_limit: int):
    values = [bytes([i]) * (300_000 + i) for i in range(3)]
    data = b"".join(b"$%d\r\n" % len(v) + v + b"\r\n" for v in values[:2])
    data += b"$-1\r\n-MOVED 1 127.0.0.1:7000\r\n$%d\r\n" % len(values[2]) + values[2] + b"\r\n"
    raw, t = _serve(data)
    sock = _CountingSocket(raw)
    r = Reader(sock, size=64 << 10)  # type: ignore[arg-type]
    sock.buffer = r._buf
    r.fill_limit = fill_limit
    got = []
    for expect in ("value", "value", None, "MOVED", "value"):
        n, other = r.head()
        if expect is None:
            assert n == -1
        elif expect == "MOVED":
            assert n == -2 and other.startswith("MOVED")
        else:
            target = bytearray(n)
            r.read_into(memoryview(target))
            r.crlf()
            got.append(bytes(target))
    t.join()
    raw.close()
    return values, got, sock.reads


def test_narrow_fills_leave_large_values_in_the_socket_for_their_target():
    from ems.cluster.resp import NARROW_FILL
    values, got, reads = _read_values(NARROW_FILL)
    assert got == values  # bit-exact through narrow fills
    into_buffer = [(asked, n) for mine, asked, n in reads if mine]
    assert into_buffer and all(asked <= NARROW_FILL for asked, _ in into_buffer)
    # what went through the buffer (and was copied a second time): a few lines and
    # headers, not the values
    assert sum(n for _, n in into_buffer) <= 8 * NARROW_FILL
    wide_values, wide_got, wide_reads = _read_values(64 << 10)
    assert wide_got == wide_values
    assert sum(n for mine, _, n in wide_reads if mine) > 16 * NARROW_FILL  # the old way


def test_skip_reads_whole_buffers_even_with_narrow_fills():
    from ems.cluster.resp import NARROW_FILL
    body = b"z" * 200_000
    raw, t = _serve(b"$%d\r\n" % len(body) + body + b"\r\n+OK\r\n")
    sock = _CountingSocket(raw)
    r = Reader(sock, size=64 << 10)  # type: ignore[arg-type]
    r.fill_limit = NARROW_FILL
    n, _ = r.head()
    r.skip(n)  # a foreign value of another size: dropped in buffer-sized reads
    r.crlf()
    assert r.reply() == "OK"
    assert len(sock.reads) < 40, sock.reads  # 200 kB in 64-byte reads would be ~3000
    t.join()
    raw.close()


def test_reader_refuses_what_is_not_resp():
    sock, t = _serve(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(RespError):
        Reader(sock).reply()
    t.join()
    sock.close()


def test_set_parts_gather_without_joining():
    a, b = socket.socketpair()
    payload = memoryview(bytearray(b"x" * 100_000))
    parts = set_parts(b"key", [b"HEAD", payload])
    assert any(p is payload for p in parts)  # the caller's memory itself, not a copy
    got = bytearray()
    t = threading.Thread(target=lambda: send_parts(a, parts) and a.close())
    t.start()
    while True:
        chunk = b.recv(1 << 16)
        if not chunk:
            break
        got += chunk
    t.join()
    b.close()
    assert bytes(got) == (b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$100004\r\nHEAD" + b"x" * 100_000
                          + b"\r\n")
    assert command("GET", b"k", 5) == b"*3\r\n$3\r\nGET\r\n$1\r\nk\r\n$1\r\n5\r\n"


def test_server_config_takes_the_cluster_from_flag_env_and_file(tmp_path):
    from ems.server.config import ServerConfig
    seed = "valkey://127.0.0.1:7000,127.0.0.1:7001"
    assert ServerConfig.load({"cluster": seed}, {}).cluster == seed
    cfg = ServerConfig.load({}, {"EMS_CLUSTER": seed, "EMS_CLUSTER_PASSWORD": "s3cret"})
    assert cfg.cluster == seed and cfg.cluster_password == "s3cret"
    assert "s3cret" not in repr(cfg) and "7000" not in repr(cfg)  # may hold credentials
    path = tmp_path / "server.toml"
    path.write_text(f'cluster = "{seed}"\ncluster_write_behind = "64M"\n')
    cfg = ServerConfig.load({"config": str(path)}, {})
    assert cfg.cluster == seed and cfg.cluster_write_behind_bytes == 64 << 20
    assert ServerConfig.load({}, {}).cluster is None  # one host, as before
    for bad in ("127.0.0.1:7000", "valkey://nohost", "valkey://h:99999"):
        with pytest.raises(EmsException) as info:
            ServerConfig.load({"cluster": bad}, {})
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
        assert "cluster" in info.value.message()


def test_request_options_travel_and_may_be_left_off():
    from ems.protocol import messages as m
    full = m.Acquire.validate([1, ["k"], [64], True, 250])
    assert full == [1, ["k"], [64], True, 250]
    # a sender that does not know the options: they mean what they meant before
    assert m.Acquire.validate([1, ["k"], [64]]) == [1, ["k"], [64], False, 0]
    assert m.Put.validate([1, ["k"], [0], [64], False]) == [1, ["k"], [0], [64], False,
                                                             True, 0, None, True]
    assert m.Reserve.validate([1, ["k"], [64]]) == [1, ["k"], [64], True, None, True, 0]
    for bad in ([1, ["k"]], [1, ["k"], [64], True, 250, 7]):
        with pytest.raises(EmsException):
            m.Acquire.validate(bad)
    with pytest.raises(EmsException):
        m.Acquire.validate([1, ["k"], [64], "yes", 0])  # an option of the wrong type
