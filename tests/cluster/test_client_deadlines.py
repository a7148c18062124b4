"""ClusterClient's deadlines against a scripted node on 127.0.0.1 (no root, no
Valkey): a read never waits behind a write to the same node, and a value that
trickles in is cut off at the deadline and is a miss. The same faults on real
Valkey nodes between network namespaces: tests/netns."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from ems.cluster import value
from ems.cluster.client import ClusterClient, Op
from ems.cluster.resp import Reader
from ems.cluster.topology import ClusterSettings

SIZE = 64 << 10


class ScriptedNode:
    """One fake node owning every slot: SET never answers (a node hung under a
    write); GET answers ``values[key]``, at ``trickle_bps`` when set; CLUSTER SLOTS
    after ``slots_delay_s``."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.values: dict[bytes, bytes] = {}
        self.trickle_bps = 0
        self.slots_delay_s = 0.0
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = Reader(conn)
        try:
            while not self.stop.is_set():
                cmd = reader.reply()
                name = cmd[0].upper()
                if name == b"CLUSTER":
                    self.stop.wait(self.slots_delay_s)
                    conn.sendall(b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d"
                                 b"\r\n$2\r\nid\r\n" % self.port)
                elif name == b"GET":
                    data = self.values[cmd[1]]
                    conn.sendall(b"$%d\r\n" % len(data))
                    self._send(conn, data + b"\r\n")
                elif name == b"SET":
                    self.stop.wait()  # hung: the write is never answered
        except (OSError, IndexError, KeyError):
            pass
        finally:
            conn.close()

    def _send(self, conn: socket.socket, data: bytes) -> None:
        if not self.trickle_bps:
            conn.sendall(data)
            return
        piece = max(1, self.trickle_bps // 100)
        for i in range(0, len(data), piece):
            if self.stop.is_set():
                return
            conn.sendall(data[i:i + piece])
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        try:  # wakes the accept() of the accepting thread (close alone does not)
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


@pytest.fixture
def node():
    n = ScriptedNode()
    client = ClusterClient(ClusterSettings((("127.0.0.1", n.port),)))
    yield n, client
    n.close()
    client.close()


def stored(n: ScriptedNode, key: bytes) -> None:
    payload = bytes(range(256)) * (SIZE // 256)
    n.values[key] = value.header(key, payload) + payload


def test_a_read_does_not_wait_behind_a_hung_write_to_the_same_node(node):
    n, client = node
    stored(n, b"r")
    payload = memoryview(bytearray(SIZE))
    write = Op("set", b"w", parts=[value.header(b"w", payload), payload])
    writer = threading.Thread(target=client.run, args=([write], time.monotonic() + 1.5))
    writer.start()
    time.sleep(0.1)  # the SET is on the wire, unanswered
    read = Op("get", b"r", target=memoryview(bytearray(SIZE)), size=SIZE)
    t0 = time.monotonic()
    client.run([read], time.monotonic() + 1.0)
    took = time.monotonic() - t0
    assert read.ok and took < 0.5, (read.ok, took)  # a hit, not behind the 1.5 s write
    writer.join()
    assert not write.ok


def test_a_value_that_trickles_in_is_cut_off_at_the_deadline(node):
    n, client = node
    stored(n, b"slow")
    n.trickle_bps = 20_000  # 64 KiB in ~3.3 s
    target = memoryview(bytearray(SIZE))
    op = Op("get", b"slow", target=target, size=SIZE)
    t0 = time.monotonic()
    client.run([op], time.monotonic() + 0.5)
    took = time.monotonic() - t0
    assert not op.ok  # a miss: the bytes that came never count as a hit
    assert took < 0.6, took  # by the deadline (+ a re-arm and a thread hop)


def test_a_read_queued_behind_a_read_stuck_on_the_node_misses_by_its_deadline(node):
    n, client = node
    stored(n, b"slow")
    stored(n, b"fast")
    n.trickle_bps = 20_000
    first = Op("get", b"slow", target=memoryview(bytearray(SIZE)), size=SIZE)
    t = threading.Thread(target=client.run, args=([first], time.monotonic() + 1))
    t.start()
    time.sleep(0.1)
    second = Op("get", b"fast", target=memoryview(bytearray(SIZE)), size=SIZE)
    t0 = time.monotonic()
    client.run([second], time.monotonic() + 0.3)
    took = time.monotonic() - t0
    t.join()
    assert not second.ok and took < 0.4, (second.ok, took)  # never sent: a miss on time


def test_requests_racing_the_first_slot_map_wait_for_it(node):
    """Two requests at start (two writers of the daemon): the first loads the slot map,
    the second waits for it instead of missing every key on an empty map."""
    n, client = node
    stored(n, b"a")
    stored(n, b"b")
    n.slots_delay_s = 0.3
    reads = [Op("get", k, target=memoryview(bytearray(SIZE)), size=SIZE) for k in (b"a", b"b")]
    threads = [threading.Thread(target=client.run, args=([op], time.monotonic() + 2.0))
               for op in reads]
    for t in threads:
        t.start()
        time.sleep(0.05)  # the first is loading the map when the second starts
    for t in threads:
        t.join()
    assert [op.ok for op in reads] == [True, True]
