"""A V1 save's ``event_hashes`` (the engine's block hashes, for the daemon's KV events)
travel in the ``hashes`` field of Put and Reserve to a real daemon."""

from __future__ import annotations

import os

import pytest
from support.itest_support import wait_for
from support.kv_events_support import v1_client

from ems import CcKvOption, EmsErrorCode, EmsException
from ems.client import remote

torch = pytest.importorskip("torch")

BS = 4


@pytest.fixture
def v1cc(server, client_env):
    client_env(server)
    with v1_client("ev") as cc:  # 16 KiB a block
        yield cc


def _chunks(blocks):
    return [[(b * BS, BS) for b in blocks]]


def test_small_and_large_saves_carry_event_hashes(v1cc, monkeypatch):
    sent = []
    real = remote._put_wire

    def spy(**kw):
        sent.append(kw["hashes"])
        return real(**kw)
    monkeypatch.setattr(remote, "_put_wire", spy)
    opt = CcKvOption(timeout=5000)
    r = v1cc.save(hashes=[1, 2], chunk_descs=_chunks([0, 1]), option=opt,
                  event_hashes=[11, (1 << 64) - 1])
    assert r.success == 2
    assert sent == [[11, (1 << 64) - 1]]  # a small save: one Put through the lease
    n = 60  # 960 KiB: more than a quarter of the 1 MiB lease: Reserve/Commit
    r = v1cc.save(hashes=list(range(100, 100 + n)), chunk_descs=_chunks(range(n)),
                  option=opt, event_hashes=list(range(n)))
    assert r.success == n and len(sent) == 1  # (no Put)
    r = v1cc.save(hashes=[3], chunk_descs=_chunks([2]), option=opt)  # none: still fine
    assert r.success == 1 and v1cc.exists([1, 2, 3, 100], opt).success == 4


def test_event_hashes_are_checked(v1cc):
    opt = CcKvOption(timeout=5000)
    for bad in ([1], [-1, 2], [1 << 64, 2], "12"):
        with pytest.raises(EmsException) as info:
            v1cc.save(hashes=[1, 2], chunk_descs=_chunks([0, 1]), option=opt,
                      event_hashes=bad)
        assert info.value.status_code() is EmsErrorCode.EMS_INVALID_ARGUMENT
    with pytest.raises(EmsException, match="event_hashes"):
        v1cc.load(hashes=[1], chunk_descs=_chunks([0]), option=opt, event_hashes=[1])


def test_a_daemon_publishes_what_it_stores_and_evicts(make_server, client_env, subscriber):
    """``ems-server --kv-events``: a V1 save with the engine's hashes -> ``BlockStored``
    of exactly those hashes (medium CPU, ownership ems-shm, the key space in the
    topic); the blocks evicted from shared memory -> ``BlockRemoved`` of theirs; one
    ``AllBlocksCleared`` at start; sequence numbers increase."""
    from support.control_support import free_port
    port = free_port()
    sub = subscriber(port)
    server = make_server(capacity="2M", extra_args=[
        "--kv-events", f"tcp://127.0.0.1:{port}", "--host-name", "host-e"])
    client_env(server)
    with v1_client("ev") as cc:  # 16 KiB a block
        opt = CcKvOption(timeout=5000)
        sub.join(cc, opt)
        first = list(range(1000, 1040))  # 40 x 16 KiB
        assert cc.save(hashes=list(range(40)), chunk_descs=_chunks(range(40)),
                       option=opt, event_hashes=first).success == 40
        # 200 more blocks (3.1 MiB) through a 2 MiB pool: the first ones are evicted
        for j in range(5):
            hs = list(range(100 + 40 * j, 140 + 40 * j))
            assert cc.save(hashes=hs, chunk_descs=_chunks(range(40)), option=opt,
                           event_hashes=[h + 5000 for h in hs]).success == 40
    stored: list[int] = []
    removed: list[int] = []
    seqs: list[int] = []

    def seen(topic: bytes, seq: int, events) -> None:
        seqs.append(seq)
        for event in events:
            if event["type"] == "BlockStored":
                assert topic.startswith(b"kv@host-e@(anonymous)@")
                assert (event["medium"], event["ownership"]) == ("CPU", "ems-shm")
                stored.extend(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                removed.extend(event["block_hashes"])
    sub.drain(lambda: set(first) <= set(removed), seen, 10.0)
    assert set(first) <= set(stored)  # every hash the engine sent
    assert set(first) <= set(removed)  # and evicted from shared memory: removed
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    report = server.stats()["kv_events"]
    assert report["published_events"] >= 2 and report["dropped_batches"] == 0


def test_the_disk_tier_publishes_its_stores_and_evictions(make_server, client_env, tmp_path,
                                                          subscriber):
    """``ems-server --disk DIR --kv-events``: a save with hashes -> ``BlockStored`` in
    shared memory (CPU, ems-shm) and, once written to disk, on the disk (STORAGE,
    ems-disk); the disk's one region evicted to make room for more -> ``BlockRemoved``
    (STORAGE, ems-disk) of the hashes it held, while shared memory (large enough for
    everything) removes none."""
    from support.control_support import free_port
    port = free_port()
    sub = subscriber(port)
    got: dict[tuple[str, str], set[int]] = {}

    def seen(topic: bytes, seq: int, events) -> None:
        for event in events:
            if event["type"] in ("BlockStored", "BlockRemoved"):
                assert event["locality"] == "LOCAL"
                assert (event["medium"], event["ownership"]) in (
                    ("CPU", "ems-shm"), ("STORAGE", "ems-disk"))
                got.setdefault((event["type"], event["ownership"]), set()).update(
                    event["block_hashes"])

    def of(kind: str, tier: str) -> set[int]:
        return got.get((kind, tier), set())
    # two 64 MiB disk regions (one would leave the tenant's disk share, a little
    # less than the disk, no region to evict while a write is in flight: refused)
    server = make_server(capacity="256M", extra_args=[
        "--disk", str(tmp_path / "disk"), "--disk-capacity", "128M",
        "--kv-events", f"tcp://127.0.0.1:{port}", "--host-name", "host-d"])
    client_env(server)
    with v1_client("ed", row=32768) as cc:  # 1 MiB a block
        opt = CcKvOption(timeout=5000)
        sub.join(cc, opt)
        first = list(range(1000, 1032))  # 32 x 1 MiB
        assert cc.save(hashes=list(range(32)), chunk_descs=_chunks(range(32)),
                       option=opt, event_hashes=first).success == 32
        sub.drain(lambda: set(first) <= of("BlockStored", "ems-disk"), seen, 20.0)
        assert set(first) <= of("BlockStored", "ems-shm")
        assert set(first) <= of("BlockStored", "ems-disk")  # written to disk
        assert not of("BlockRemoved", "ems-disk")
        # 160 more blocks (160 MiB) fill the disk: its first region is evicted
        for j in range(5):
            hs = list(range(100 + 32 * j, 132 + 32 * j))
            assert cc.save(hashes=hs, chunk_descs=_chunks(range(32)), option=opt,
                           event_hashes=[h + 5000 for h in hs]).success == 32
        sub.drain(lambda: set(first) <= of("BlockRemoved", "ems-disk"), seen, 60.0)
    disk = server.stats()["disk"]
    assert set(first) <= of("BlockRemoved", "ems-disk"), (disk, server.stats()["kv_events"])
    assert not of("BlockRemoved", "ems-shm")  # shared memory still holds them
    assert disk["regions_evicted"] >= 1


def _replayed(zmq, endpoint: str) -> list[dict]:
    """Every event the daemon still buffers, from sequence 0 (vLLM's replay protocol)."""
    from ems.server.kv_events import decode_batch
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    events: list[dict] = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(5000):
            _, _topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return events
            events.extend(decode_batch(payload)[1])
        raise AssertionError("the replay did not end")
    finally:
        dealer.close(0)
        ctx.term()


def test_a_restart_announces_what_the_disk_recovered(make_server, client_env, tmp_path,
                                                      monkeypatch):
    """``disk.announce_recovered`` (on by default): a daemon stopped cleanly and started
    again on the same disk publishes ``AllBlocksCleared`` and then
    ``BlockStored(ems-disk)`` of exactly the hashes of the records it recovered; with
    the setting off, only ``AllBlocksCleared``. The side file survives a crash too
    (``kill -9``): what it held at the last interval is announced."""
    zmq = pytest.importorskip("zmq")
    from support.control_support import free_port
    disk = tmp_path / "disk"

    def start(announce: bool = True):
        port, replay = free_port(), free_port()
        config = tmp_path / f"ems-{port}.toml"
        config.write_text(f"[disk]\nannounce_recovered = {str(announce).lower()}\n"
                          "checkpoint_s = 0.2\n")
        server = make_server(capacity="64M", extra_args=[
            "--config", str(config), "--disk", str(disk),
            "--kv-events", f"tcp://127.0.0.1:{port}",
            "--kv-events-replay", f"tcp://127.0.0.1:{replay}", "--host-name", "host-r"])
        return server, f"tcp://127.0.0.1:{replay}"

    def stored_on_disk(events) -> set[int]:
        return {h for e in events if e["type"] == "BlockStored"
                and e["ownership"] == "ems-disk" for h in e["block_hashes"]}
    server, replay = start()
    client_env(server)
    with v1_client("er") as cc:  # 16 KiB a block
        opt = CcKvOption(timeout=5000)
        hashes = list(range(7000, 7020))
        assert cc.save(hashes=list(range(20)), chunk_descs=_chunks(range(20)), option=opt,
                       event_hashes=hashes).success == 20
        cc.save(hashes=[50, 51], chunk_descs=_chunks([0, 1]), option=opt)  # no hashes
        wait_for(lambda: set(hashes) <= stored_on_disk(_replayed(zmq, replay)), 20.0,
                 "the records on disk")
    server.stop()  # SIGTERM: the side file written last
    stopped = os.path.getmtime(disk / "kv-hashes")
    server, replay = start()
    events = wait_for(lambda: (got := _replayed(zmq, replay)) and
                      set(hashes) <= stored_on_disk(got) and got, 20.0, "the announcement")
    assert events[0]["type"] == "AllBlocksCleared"
    assert stored_on_disk(events) == set(hashes)  # exactly what the engine sent
    assert not [e for e in events if e["type"] == "BlockStored"
                and e["ownership"] == "ems-shm"]  # only the disk holds them now
    assert server.stats()["disk"]["announced_recovered"] == 20
    # a crash: the side file of the last interval (0.2 s) is what it announces. (Its
    # first rewrite by the new daemon, one interval after the announcement, may come
    # before the test has seen the announcement: compared with the stop's file.)
    wait_for(lambda: os.path.getmtime(disk / "kv-hashes") > stopped, 10.0,
             "the side file rewritten")
    server.kill()
    server, replay = start()
    wait_for(lambda: set(hashes) <= stored_on_disk(_replayed(zmq, replay)), 20.0,
             "the announcement after a crash")
    server.stop()
    server, replay = start(announce=False)
    wait_for(lambda: server.stats()["disk"]["state"] == "ok", 20.0, "recovery")
    events = _replayed(zmq, replay)  # (with the setting off nothing announces later)
    assert [e["type"] for e in events] == ["AllBlocksCleared"]
    assert server.stats()["disk"]["announced_recovered"] == 0
