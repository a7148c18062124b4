"""The cluster changes under the bed's hosts: a node added and a slot moved to it
under load, and a primary killed with a replica on another host (failover)."""

from __future__ import annotations

import threading
import time

import pytest
from support.netns_support import Host, ckey, keys_on, wait_stored

from ems import PrimaryKey
from ems.cluster.keys import hash_slot
from ems.cluster.resp import ErrorReply
from ems.testing import netns

SMALL = 16 << 10


@pytest.fixture(scope="module")
def rbed(tmp_path_factory):
    """3 hosts, each with a primary and a replica of the previous host's primary."""
    with netns.NetBed(3, str(tmp_path_factory.mktemp("netbed")), replicas=True,
                      node_timeout_ms=1000) as b:
        hosts = {i: Host(b, i, b.server(i, capacity="128M")) for i in (1, 2)}
        try:
            yield b, hosts
        finally:
            for h in hosts.values():
                h.close()


def test_a_node_added_and_a_slot_moved_to_it_under_load(rbed):
    bed, h = rbed
    keys = [PrimaryKey("mig", f"k{i}") for i in range(120)]  # one slot, which moves
    names = [ckey(k) for k in keys]
    assert len({hash_slot(n) for n in names}) == 1
    assert h[2].save(keys, SMALL, write_rcache=False) == 120
    slot, src = hash_slot(names[0]), bed.node_of(names[0])
    new_id = bed.add_node(3)
    port = netns.NODE_PORT + 2
    deadline = time.monotonic() + 15
    while (bed.call(src, "CLUSTER", "NODES").decode().count("connected") < 7
           or "cluster_state:ok" not in bed.call(3, "CLUSTER", "INFO", port=port).decode()):
        assert time.monotonic() < deadline, "the new node did not join"
        time.sleep(0.05)
    src_id = bed.call(src, "CLUSTER", "MYID").decode()
    results = {"hit": 0, "miss": 0, "wrong": 0, "errors": 0}
    slowest = 0.0

    def reader() -> None:
        nonlocal slowest
        for k in keys:  # each key once: every load goes to the cluster
            got = h[1].load([k], SMALL, timeout_ms=1000)
            slowest = max(slowest, got.took_s)
            results["hit" if got.hits else "miss"] += 1
            results["wrong"] += got.wrong
            results["errors"] += got.error is not None
            time.sleep(0.002)
    assert bed.call(3, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id, port=port) == "OK"
    assert bed.call(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", new_id) == "OK"
    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(0, len(names), 4):  # slowly: the reads run while the slot moves
            reply = bed.call(src, "MIGRATE", bed.addr(3), port, "", 0, 5000, "KEYS",
                             *names[i:i + 4])
            assert not isinstance(reply, ErrorReply), reply
            time.sleep(0.02)
        # every node learns the slot's new owner: the new node first, then the old
        # (else a read MOVED to the new node, still IMPORTING, is MOVED back)
        order = [(3, port), (src, netns.NODE_PORT)]
        for j, p in order + [n for n in bed.nodes if n not in order]:
            bed.call(j, "CLUSTER", "SETSLOT", slot, "NODE", new_id, port=p)
    finally:
        t.join(60)
    assert results == {"hit": 120, "miss": 0, "wrong": 0, "errors": 0}, results
    redirects = h[1].server.stats()["cluster"]["redirects"]
    assert redirects["ask"] + redirects["moved"] > 0  # the reads did meet the move
    print(f"\nslot {slot} moved to a node added on host 3 under 120 loads: {results}, "
          f"slowest {slowest * 1000:.0f} ms, redirects {redirects}")


def test_a_primary_killed_fails_over_to_its_replica_on_another_host(rbed):
    bed, h = rbed
    keys = keys_on(bed, 2, "fo", 40)
    assert h[1].save(keys, SMALL, write_rcache=False) == 40  # no local copy on host 1
    wait_stored(bed, keys)
    deadline = time.monotonic() + 10  # node 2's replica is on host 3, port 7001
    while bed.call(3, "DBSIZE", port=netns.NODE_PORT + 1) < 40:
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.05)
    assert h[1].load(keys[:1], SMALL).hits == 1
    bed.kill_node(2)
    t0 = time.monotonic()
    outcomes = []
    while True:  # the same key: a miss fills nothing
        got = h[1].load(keys[1:2], SMALL, timeout_ms=500)
        outcomes.append(got)
        if got.hits:
            break
        assert time.monotonic() - t0 < 20, "no hit after the failover"
        time.sleep(0.05)
    back = time.monotonic() - t0
    assert all(g.error is None and g.wrong == 0 and g.took_s < 0.5 for g in outcomes), \
        outcomes
    assert outcomes[-1].hits == 1
    print(f"\nprimary of host 2 killed: {len(outcomes) - 1} misses (slowest "
          f"{max(g.took_s for g in outcomes) * 1000:.0f} ms of 500), hits again from its "
          f"replica on host 3 {back:.2f} s after the SIGKILL (cluster-node-timeout 1000)")
