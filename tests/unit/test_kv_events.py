"""The KV events publisher (``ems.server.kv_events``) on its own: real ZMQ sockets on
localhost, the wire decoded with msgpack (tests/vllm/test_kv_events_vllm.py decodes
it with vLLM's own decoder)."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")

from ems.server.kv_events import (  # noqa: E402
    END_SEQ,
    KvEventPublisher,
    decode_batch,
    space_of,
)

KEY_SPACE = "0123456789abcdef01234567"


def _key(h: int) -> str:
    return f"v1:{KEY_SPACE}:{h}"


@pytest.fixture
def publisher():
    pub = KvEventPublisher("tcp://127.0.0.1:0", host="host-a",
                           replay_endpoint="tcp://127.0.0.1:0")
    yield pub
    pub.close()


@pytest.fixture
def subscriber(publisher):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(publisher.endpoint)
    time.sleep(0.3)  # a PUB drops what it sends before the subscription arrives
    yield sub
    sub.close(0)
    ctx.term()


def _receive(sub, n: int, timeout_s: float = 5.0) -> list[tuple[bytes, int, float, list]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        assert sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), \
            f"{len(out)} of {n} messages"
        topic, seq, payload = sub.recv_multipart()
        assert len(seq) == 8
        ts, events = decode_batch(payload)
        if events == [{"type": "AllBlocksCleared"}]:
            continue  # the publisher's start, if it came after the subscription
        out.append((topic, int.from_bytes(seq, "big"), ts, events))
    return out


def test_stored_removed_in_vllms_fields_with_increasing_seq(publisher, subscriber):
    t0 = time.time()
    hashes = [1, (1 << 64) - 1, 1 << 63]  # unsigned 64-bit, the top bit too
    publisher.stored("tenant-1", hashes, "ems-shm", keys=[_key(h) for h in range(3)])
    publisher.removed("tenant-1", hashes[:1], "ems-disk")
    publisher.stored("tenant-2", [7], "ems-cluster")
    msgs = _receive(subscriber, 3)
    topics = [m[0] for m in msgs]
    assert topics == [f"kv@host-a@tenant-1@{KEY_SPACE}".encode(),
                      b"kv@host-a@tenant-1@-", b"kv@host-a@tenant-2@-"]
    seqs = [m[1] for m in msgs]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    assert all(t0 - 1 < m[2] < time.time() + 1 for m in msgs)
    stored = msgs[0][3][0]
    assert stored == {"type": "BlockStored", "block_hashes": hashes,
                      "parent_block_hash": None, "token_ids": [], "block_size": 0,
                      "lora_id": None, "medium": "CPU", "lora_name": None,
                      "locality": "LOCAL", "ownership": "ems-shm"}
    removed = msgs[1][3][0]
    assert removed == {"type": "BlockRemoved", "block_hashes": [1], "medium": "STORAGE",
                       "locality": "LOCAL", "ownership": "ems-disk"}
    assert msgs[2][3][0]["locality"] == "REMOTE"
    assert msgs[2][3][0]["ownership"] == "ems-cluster"
    deadline = time.monotonic() + 5  # the sender counts a batch just after sending it
    while publisher.statistics().published_hashes < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    s = publisher.statistics()
    assert s.published_hashes >= 5 and s.dropped_batches == 0


def test_evicted_keys_name_the_hashes_they_were_stored_with(publisher, subscriber):
    publisher.stored("t", [11, 12, 13], keys=[_key(1), _key(2), _key(3)])
    publisher.evicted("t", [_key(3), _key(1), "v1:other:9"])
    publisher.evicted("other-tenant", [_key(2)])  # another tenant's key of that name
    stored, removed = _receive(subscriber, 2)
    assert removed[0] == f"kv@host-a@t@{KEY_SPACE}".encode()
    assert removed[3][0]["block_hashes"] == [13, 11]
    s = publisher.statistics()
    assert s.untracked_removals == 2 and s.tracked_keys == 1


def test_one_map_serves_every_tier_until_the_last_one_removes_a_key(publisher, subscriber):
    """The disk copies keys from shared memory (``copied``: BlockStored there of the
    hash their save brought); a key leaves the map only when no tier holds it, and a
    tier that never held a key removes nothing of it."""
    publisher.stored("t", [21, 22], keys=[_key(1), _key(2)])
    publisher.copied("t", [_key(1), _key(2), _key(3)], "ems-disk")  # _key(3): no hash
    publisher.evicted("t", [_key(1)], "ems-shm")  # still on disk: still tracked
    publisher.evicted("t", [_key(1)], "ems-shm")  # no longer in shared memory
    assert publisher.statistics().tracked_keys == 2
    publisher.evicted("t", [_key(1), _key(2)], "ems-disk")
    publisher.evicted("t", [_key(1)], "ems-disk")  # forgotten now: untracked
    got = [(events[0]["type"], events[0]["medium"], events[0]["ownership"],
            events[0]["block_hashes"]) for _, _, _, events in _receive(subscriber, 4)]
    assert got == [("BlockStored", "CPU", "ems-shm", [21, 22]),
                   ("BlockStored", "STORAGE", "ems-disk", [21, 22]),
                   ("BlockRemoved", "CPU", "ems-shm", [21]),
                   ("BlockRemoved", "STORAGE", "ems-disk", [21, 22])]
    s = publisher.statistics()
    assert s.tracked_keys == 1 and s.untracked_removals == 2  # _key(2) in shared memory


def test_tracked_keys_are_bounded_oldest_first():
    pub = KvEventPublisher("tcp://127.0.0.1:0", host="h", max_tracked_keys=2)
    try:
        pub.stored("t", [1, 2, 3], keys=["k1", "k2", "k3"])
        assert pub.statistics().tracked_keys == 2
        pub.evicted("t", ["k1", "k2", "k3"])
        assert pub.statistics().untracked_removals == 1  # k1 was forgotten
    finally:
        pub.close()


def test_a_full_queue_drops_the_oldest_and_counts_it():
    pub = KvEventPublisher("tcp://127.0.0.1:0", host="h", max_queue_batches=2)
    try:
        deadline = time.monotonic() + 5
        while pub.statistics().published_batches < 1:  # AllBlocksCleared went
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pub._lock:  # the sender cannot take any batch meanwhile
            for i in range(5):
                pub._put_locked(b"kv@h@t@-", {"type": "BlockRemoved", "block_hashes": [i],
                                               "medium": "CPU"})
            assert [body[1][0]["block_hashes"] for _, body in pub._queue] == [[3], [4]]
        assert pub.statistics().dropped_batches == 3
    finally:
        pub.close()


def test_all_blocks_cleared_first_then_replay_from_a_seq(publisher):
    publisher.stored("t", [5], keys=[_key(5)])
    publisher.stored("t", [6], keys=[_key(6)])
    deadline = time.monotonic() + 5
    while publisher.statistics().published_batches < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(publisher.replay_endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert req.poll(5000)
            _, topic, seq, payload = req.recv_multipart()
            if seq == END_SEQ:
                break
            got.append((topic, int.from_bytes(seq, "big"), decode_batch(payload)[1]))
        assert [g[1] for g in got] == [0, 1, 2]
        assert got[0][0] == b"kv@host-a@" and got[0][2] == [{"type": "AllBlocksCleared"}]
        assert [g[2][0]["block_hashes"] for g in got[1:]] == [[5], [6]]
        req.send_multipart([b"", (2).to_bytes(8, "big")])  # from seq 2 on
        assert req.poll(5000)
        assert int.from_bytes(req.recv_multipart()[2], "big") == 2
        assert req.poll(5000) and req.recv_multipart()[2] == END_SEQ
        assert publisher.statistics().replays == 2
    finally:
        req.close(0)
        ctx.term()


def test_unknown_tier_and_key_spaces():
    pub = KvEventPublisher("tcp://127.0.0.1:0", host="h")
    try:
        with pytest.raises(ValueError, match="unknown ems tier"):
            pub.stored("t", [1], "GPU")
    finally:
        pub.close()
    assert space_of(f"v1:{KEY_SPACE}:-5") == KEY_SPACE
    assert space_of("v0:p:3:abc") == "v0" and space_of("x") == "-"


def test_config_flag_file_and_environment(tmp_path):
    from ems.errors import EmsException
    from ems.server.config import ServerConfig

    flags = {"kv_events": "tcp://0.0.0.0:5557", "kv_events_replay": "tcp://0.0.0.0:5558"}
    c = ServerConfig.load(flags, {})
    assert (c.kv_events, c.kv_events_replay) == ("tcp://0.0.0.0:5557", "tcp://0.0.0.0:5558")
    assert ServerConfig.load({}, {"EMS_KV_EVENTS": "tcp://h:1"}).kv_events == "tcp://h:1"
    path = tmp_path / "ems.toml"
    path.write_text('kv_events = "tcp://127.0.0.1:7000"\n')
    assert ServerConfig.load({"config": str(path)}, {}).kv_events == "tcp://127.0.0.1:7000"
    assert ServerConfig.load({}, {}).kv_events is None  # off by default
    for bad in ("127.0.0.1:5557", "tcp://:5557", "tcp://h:port", "ipc:///x"):
        with pytest.raises(EmsException, match="kv_events"):
            ServerConfig.load({"kv_events": bad}, {})
    with pytest.raises(EmsException, match="needs kv_events"):
        ServerConfig.load({"kv_events_replay": "tcp://h:1"}, {})


def test_ems_server_publishes_all_blocks_cleared_at_start(tmp_path):
    """The daemon binary with --kv-events: a replay from seq 0 gets AllBlocksCleared."""
    import os
    import socket
    import subprocess
    import sys

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    pub, replay = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ems.server", "--socket-dir", str(tmp_path), "--capacity",
         "16M", "--host-name", "node-7", "--kv-events", f"tcp://127.0.0.1:{pub}",
         "--kv-events-replay", f"tcp://127.0.0.1:{replay}"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(f"tcp://127.0.0.1:{replay}")
        deadline = time.monotonic() + 30
        frames = None
        while frames is None:  # until the daemon has bound its replay socket
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            req.send_multipart([b"", (0).to_bytes(8, "big")])
            if req.poll(500):
                frames = req.recv_multipart()
        _, topic, seq, payload = frames
        assert topic == b"kv@node-7@" and seq == (0).to_bytes(8, "big")
        assert decode_batch(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        req.close(0)
        ctx.term()
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()
