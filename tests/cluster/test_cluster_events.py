"""KV events of the cluster tier on a real Valkey Cluster: what this host wrote there
arrives as ``BlockStored(ems-cluster)`` (CPU, REMOTE) with the engine's hashes, for a
write-behind and for a save written through; a key this host announced and a home node
then answers it does not hold arrives as ``BlockRemoved(ems-cluster)``, and another
host's keys found missing are neither published nor counted."""

from __future__ import annotations

import pytest
from support.control_support import free_port
from support.kv_events_support import Subscriber, v1_client

from ems import CcKvOption
from ems.cluster import launcher
from ems.testing import run_server

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

BS = 4


def _chunks(blocks):
    return [[(b * BS, BS) for b in blocks]]


def test_the_cluster_tier_publishes_what_this_host_wrote_and_found_gone(
        make_cluster, tmp_path, monkeypatch):
    cluster = make_cluster()
    port = free_port()
    sub = Subscriber(zmq, port)
    got: dict[tuple[str, str], set[int]] = {}

    def seen(topic: bytes, seq: int, events) -> None:
        for event in events:
            if event["type"] in ("BlockStored", "BlockRemoved"):
                tier = event["ownership"]
                if tier == "ems-cluster":
                    assert (event["medium"], event["locality"]) == ("CPU", "REMOTE")
                got.setdefault((event["type"], tier), set()).update(event["block_hashes"])

    def of(kind: str, tier: str) -> set[int]:
        return got.get((kind, tier), set())
    (tmp_path / "host").mkdir()
    try:
        with run_server(str(tmp_path / "host"), capacity="64M", extra_args=[
                "--cluster", cluster.seed, "--kv-events", f"tcp://127.0.0.1:{port}",
                "--host-name", "host-c"]) as server:
            for name, value in server.client_env().items():
                monkeypatch.setenv(name, value)
            with v1_client("ce") as cc:  # 16 KiB a block
                opt = CcKvOption(timeout=5000)
                sub.join(cc, opt, BS)
                behind = list(range(1000, 1010))  # stored here, then written behind
                assert cc.save(hashes=list(range(10)), chunk_descs=_chunks(range(10)),
                               option=opt, event_hashes=behind).success == 10
                # a save written through: the home node only, never in shared memory
                through = list(range(2000, 2006))
                assert cc.save(hashes=list(range(100, 106)), chunk_descs=_chunks(range(6)),
                               option=CcKvOption(timeout=5000, write_rcache=False),
                               event_hashes=through).success == 6, server.stats()["cluster"]
                sub.drain(lambda: set(behind + through) <= of("BlockStored", "ems-cluster"),
                          seen, 15.0)
                assert set(behind) <= of("BlockStored", "ems-shm")
                assert set(behind + through) <= of("BlockStored", "ems-cluster"), (
                    server.stats()["cluster"], server.log()[-3000:])
                assert not set(through) & of("BlockStored", "ems-shm")
                # Valkey loses them (as under maxmemory): this host learns it when it
                # asks; a key nobody here wrote, missing too, says nothing
                for node in cluster.primaries:
                    launcher.call(node.port, "FLUSHALL")
                before = server.stats()["kv_events"]["untracked_removals"]
                assert cc.exists(hashes=list(range(100, 106)) + [999], option=opt
                                 ).success == 0
                assert cc.load(hashes=[100, 101, 102, 103, 104, 105],
                               chunk_descs=_chunks(range(6)), option=opt).success == 0
                sub.drain(lambda: set(through) <= of("BlockRemoved", "ems-cluster"),
                          seen, 15.0)
                assert set(through) <= of("BlockRemoved", "ems-cluster")
                # the write-behind keys are still in shared memory: not asked, not removed
                assert not set(behind) & of("BlockRemoved", "ems-cluster")
                assert server.stats()["kv_events"]["untracked_removals"] == before
    finally:
        sub.close()
