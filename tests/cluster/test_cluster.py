"""The shared tier end to end: a real Valkey Cluster (3 primaries, started here on
127.0.0.1), two ems-server daemons joined to it = two simulated hosts, the SDK on each.

Figures the tests measure are printed (``-s``), never asserted as timings, except for
the promises: a miss comes back within the request's deadline.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from support.cluster_support import Host, load, opt, save, wait_until

from ems import PrimaryKey
from ems.cluster import launcher
from ems.cluster.keys import cluster_key, hash_slot
from ems.cluster.resp import ErrorReply
from ems.keys import v0_storage_keys

SIZE = 64 << 10


def owner(c: launcher.LocalCluster, key: bytes) -> int:
    """Port of the primary that owns ``key``'s slot now."""
    slot = hash_slot(key)
    for entry in launcher.call(c.primaries[0].port, "CLUSTER", "SLOTS"):
        if int(entry[0]) <= slot <= int(entry[1]):
            return int(entry[2][1])
    raise AssertionError(f"slot {slot} is not served")


def ckey(key, tenant: str = "(anonymous)") -> bytes:
    return cluster_key(tenant, v0_storage_keys([key])[0])


# ---------------------------------------------------------------- the basics

def test_keyslot_agrees_with_the_server(shared_cluster):
    port = shared_cluster.primaries[0].port
    samples = [b"123456789", b"ems:{t/a}:b", b"{}x", b"a{b}c{d}", b"{{x}}", b"", b"\xff\x00"]
    samples += [ckey(PrimaryKey(f"d{{{i}}}", f"a}}{i}")) for i in range(50)]
    for key in samples:
        assert launcher.call(port, "CLUSTER", "KEYSLOT", key) == hash_slot(key), key


def test_a_saves_b_loads_bit_exact_and_one_distribute_key_is_one_node(shared_cluster,
                                                                       make_host):
    a, b = make_host(shared_cluster.seed), make_host(shared_cluster.seed)
    keys = [PrimaryKey("doc-{7}", f"layer{i}") for i in range(12)]
    assert save(a, keys, SIZE, opt(write_rcache=False)) == 12  # on the home node now
    assert load(b, keys, SIZE) == (12, 0)
    home = owner(shared_cluster, ckey(keys[0]))
    for n in shared_cluster.primaries:
        found = launcher.call(n.port, "KEYS", "ems:{(anonymous)/doc-%7B7%7D}:*")
        assert len(found) == (12 if n.port == home else 0), n.port
    slots = {launcher.call(home, "CLUSTER", "KEYSLOT", ckey(k)) for k in keys}
    assert len(slots) == 1
    row = b.report()["cluster"]["tier"]
    assert row["hits"] >= 12 and row["bytes_in"] >= 12 * SIZE


def test_write_rcache_false_keeps_no_local_copy(shared_cluster, make_host):
    a, b = make_host(shared_cluster.seed), make_host(shared_cluster.seed)
    small, big = [f"wt-small-{i}" for i in range(4)], [f"wt-big-{i}" for i in range(2)]
    assert save(a, small, 4096, opt(write_rcache=False)) == 4  # the lease path (Put)
    assert save(a, big, 1 << 20, opt(write_rcache=False)) == 2  # Reserve + Commit
    row = a.tenant_row()
    assert row["objects"] == 0 and row["reserved"] == 0 and row["pinned"] == 0
    assert load(a, small, 4096, opt(read_local_only=True)) == (0, 0)
    for k in small + big:
        assert launcher.call(owner(shared_cluster, ckey(k)), "EXISTS", ckey(k)) == 1
    assert load(b, small, 4096) == (4, 0) and load(b, big, 1 << 20) == (2, 0)


def test_read_local_only_before_and_after_a_read_cache_fill(shared_cluster, make_host):
    a, b = make_host(shared_cluster.seed), make_host(shared_cluster.seed)
    keys = [f"rlo-{i}" for i in range(5)]
    assert save(a, keys, SIZE, opt(write_rcache=False)) == 5
    assert load(b, keys, SIZE, opt(read_local_only=True)) == (0, 0)
    assert load(b, keys, SIZE) == (5, 0)  # from the cluster: fills b's read cache
    assert b.tenant_row()["objects"] == 5
    assert load(b, keys, SIZE, opt(read_local_only=True)) == (5, 0)


def test_exists_honours_read_local_only(shared_cluster, make_host):
    torch = pytest.importorskip("torch")
    from ems import CcConfig_v1
    cfg = CcConfig_v1(rank_id=0, device_id=0, model_id="m", llm_engine="vllm@cluster")
    a, b = make_host(shared_cluster.seed, v1=cfg), make_host(shared_cluster.seed, v1=cfg)
    caches = [[torch.rand(8, 4, 2, 8) for _ in range(2)] for _ in range(2)]
    a.cc.register_kvcache(caches)
    b.cc.register_kvcache([[torch.zeros(8, 4, 2, 8) for _ in range(2)] for _ in range(2)])
    slots = list(range(0, 12))
    assert a.cc.save(slots, [901, 902, 903], [4, 4, 4],
                     option=opt(write_rcache=False)).success == 3
    assert b.cc.exists([901, 902, 903], opt(read_local_only=True)).success == 0
    assert b.cc.exists([901, 902, 903, 904]).success == 3
    assert b.cc.exists([901, 902], offsets=[4, 4]).success == 2
    assert b.cc.exists([901, 902], offsets=[4, 3]).success == 1  # stored with 4 tokens


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_v1_blocks_cross_hosts_bit_exact(shared_cluster, make_host, kind):
    torch = pytest.importorskip("torch")
    from ems import CcConfig_v1, KVCacheType
    cfg = CcConfig_v1(rank_id=0, device_id=0, model_id=f"m-{kind}", llm_engine="vllm@cluster",
                      kvcache_type=KVCacheType(kind))
    a, b = make_host(shared_cluster.seed, v1=cfg), make_host(shared_cluster.seed, v1=cfg)
    if kind == "MHA":
        def make(fill):
            return [[(torch.rand if fill else torch.zeros)(16, 4, 2, 16) for _ in range(2)]
                    for _ in range(3)]
    else:
        def make(fill):
            f = (lambda *s, dtype: torch.rand(*s).to(dtype)) if fill else (
                lambda *s, dtype: torch.zeros(*s, dtype=dtype))
            return [[f(16, 4, 1, 32, dtype=torch.bfloat16), f(16, 4, 1, 8, dtype=torch.float16)]
                    for _ in range(3)]
    src, dst = make(True), make(False)
    a.cc.register_kvcache(src)
    b.cc.register_kvcache(dst)
    hashes = [7000 + i for i in range(8)]  # 8 blocks: spread over the nodes
    slots = list(range(8 * 4))
    assert a.cc.save(slots, hashes, [4] * 8, option=opt(write_rcache=False)).success == 8
    assert b.cc.load(slots, hashes, [4] * 8, option=opt()).success == 8
    for ls, ld in zip(src, dst):
        for s, d in zip(ls, ld):
            assert torch.equal(s[:8].view(torch.uint8), d[:8].view(torch.uint8))
    prefix = b.cc._v1_prefix
    nodes = {owner(shared_cluster, cluster_key("(anonymous)", f"{prefix}{h}")) for h in hashes}
    assert len(nodes) >= 2  # a block's own hash spreads a prefix over the nodes


def test_a_prefix_split_across_tiers(shared_cluster, make_host):
    a, b = make_host(shared_cluster.seed), make_host(shared_cluster.seed)
    keys = [f"split-{i}" for i in range(8)]
    assert save(a, keys, SIZE, opt(write_rcache=False)) == 8
    assert load(b, keys[:3], SIZE) == (3, 0)  # b's read cache: the first 3
    before = b.report()
    assert load(b, keys, SIZE) == (8, 0)  # 3 local + 5 from the cluster
    after = b.report()
    t0, t1 = before["tenants"]["(anonymous)"], after["tenants"]["(anonymous)"]
    assert t1["hits"] - t0["hits"] == 3
    assert after["cluster"]["tier"]["hits"] - before["cluster"]["tier"]["hits"] == 5
    # a hole in the middle: success counts the leading run across both tiers
    assert load(b, keys[:4] + ["split-none"] + keys[4:], SIZE) == (4, 0)


def test_concurrent_loads_of_the_same_blocks_fetch_them_once(shared_cluster, make_host):
    a, b = make_host(shared_cluster.seed), make_host(shared_cluster.seed)
    keys = [PrimaryKey("mla", f"blk{i}") for i in range(16)]
    assert save(a, keys, SIZE, opt(write_rcache=False)) == 16
    ranks = [Host(b.server) for _ in range(3)]  # TP ranks of an MLA model on host b
    try:
        before = b.report()["cluster"]["tier"]["lookups"]
        got: list = [None] * len(ranks)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(
            i, load(ranks[i], keys, SIZE))) for i in range(len(ranks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert got == [(16, 0)] * len(ranks)
        fetched = b.report()["cluster"]["tier"]["lookups"] - before
        assert fetched == 16  # each block came over the network once
    finally:
        for r in ranks:
            r.close()


def test_write_behind_becomes_visible_on_another_host(shared_cluster, make_host):
    a, b = make_host(shared_cluster.seed), make_host(shared_cluster.seed)
    lags = []
    for i in range(15):
        key = f"wb-{i}"
        assert save(a, [key], SIZE) == 1  # local now, written behind
        t0 = time.monotonic()
        wait_until(lambda key=key: launcher.call(owner(shared_cluster, ckey(key)), "EXISTS",
                                                 ckey(key)) == 1, 5.0, f"{key} on its home node")
        lags.append(time.monotonic() - t0)
    assert load(b, [f"wb-{i}" for i in range(15)], SIZE) == (15, 0)
    lags.sort()
    print(f"\nwrite-behind: visible on the home node {lags[len(lags) // 2] * 1000:.2f} ms "
          f"after save returned (p50), {lags[-1] * 1000:.2f} ms max, {SIZE >> 10} KiB values")


def test_two_tenants_stay_apart_across_hosts(shared_cluster, make_host):
    keys = {"team-a": "A" * 40, "team-b": "B" * 40}
    a = make_host(shared_cluster.seed, "team-a", keys["team-a"], tenants=keys, anonymous=False)
    b_other = make_host(shared_cluster.seed, "team-b", keys["team-b"], tenants=keys,
                        anonymous=False)
    assert save(a, ["secret"], SIZE, opt(write_rcache=False)) == 1
    assert load(b_other, ["secret"], SIZE) == (0, 0)
    b_same = make_host(shared_cluster.seed, "team-a", keys["team-a"], tenants=keys,
                       anonymous=False)
    assert load(b_same, ["secret"], SIZE) == (1, 0)
    # each tenant's cluster counters in its row (tiers.cluster, as the control plane
    # shows them)
    other = b_other.report()["tenants"]["team-b"]["tiers"]["cluster"]
    same = b_same.report()["tenants"]["team-a"]["tiers"]["cluster"]
    assert (other["hits"], other["misses"]) == (0, 1)
    assert (same["hits"], same["misses"], same["hit_rate"]) == (1, 0, 1.0)
    assert a.report()["tenants"]["team-a"]["tiers"]["cluster"]["writes"] == 1


def test_a_corrupt_short_or_foreign_value_is_a_miss(shared_cluster, make_host):
    a, b = make_host(shared_cluster.seed), make_host(shared_cluster.seed)
    keys = ["bad-flip", "bad-short", "bad-foreign", "bad-donor"]
    assert save(a, keys, SIZE, opt(write_rcache=False)) == 4
    flip, short, foreign, donor = (ckey(k) for k in keys)
    port = owner(shared_cluster, flip)
    assert launcher.call(port, "SETRANGE", flip, 32 + 1000, b"\x00\xff") > 0  # payload
    port = owner(shared_cluster, short)
    whole = launcher.call(port, "GET", short)
    assert launcher.call(port, "SET", short, whole[:-10]) == "OK"
    donor_bytes = launcher.call(owner(shared_cluster, donor), "GET", donor)
    assert launcher.call(owner(shared_cluster, foreign), "SET", foreign, donor_bytes) == "OK"
    for k in keys[:3]:
        assert load(b, [k], SIZE) == (0, 0), k
    assert b.tenant_row()["objects"] == 0  # nothing unverified reached the read cache
    assert load(b, ["bad-donor"], SIZE) == (1, 0)


# ---------------------------------------------------------------- failures

def test_a_killed_node_misses_within_the_deadline_and_the_rest_hit(make_cluster, make_host):
    c = make_cluster(nodes=3)
    a, b = make_host(c.seed), make_host(c.seed)
    keys = [f"kill-{i}" for i in range(30)]
    assert save(a, keys, SIZE, opt(write_rcache=False)) == 30
    victim = owner(c, ckey(keys[0]))
    on_victim = {k for k in keys if owner(c, ckey(k)) == victim}
    c.kill(victim, signal.SIGKILL)
    times = []
    for k in keys:
        t0 = time.monotonic()
        got = load(b, [k], SIZE, opt(timeout=1000))
        times.append(time.monotonic() - t0)
        assert got == ((0, 0) if k in on_victim else (1, 0)), k
        assert times[-1] < 1.0  # the deadline is a promise
    nodes = {n["node"]: n for n in b.report()["cluster"]["nodes"]}
    assert nodes[f"127.0.0.1:{victim}"]["state"] in ("open", "half-open")
    print(f"\nkilled node: {len(on_victim)} keys missed, {30 - len(on_victim)} hit; load "
          f"latency max {max(times) * 1000:.1f} ms")


def test_a_hung_node_misses_within_the_deadline_then_is_skipped(make_cluster, make_host):
    c = make_cluster(nodes=3)
    a, b = make_host(c.seed), make_host(c.seed)
    keys = [f"hung-{i}" for i in range(30)]
    assert save(a, keys, SIZE, opt(write_rcache=False)) == 30
    assert load(b, keys[:1], SIZE) == (1, 0)  # b is connected to the nodes
    victim = owner(c, ckey(keys[1]))
    on_victim = [k for k in keys[1:] if owner(c, ckey(k)) == victim]
    others = [k for k in keys[1:] if k not in on_victim]
    c.kill(victim, signal.SIGSTOP)
    try:
        times = []
        for k in on_victim[:4]:
            t0 = time.monotonic()
            assert load(b, [k], SIZE, opt(timeout=500)) == (0, 0)
            times.append(time.monotonic() - t0)
        assert max(times) < 0.5  # a miss within the deadline, not an error
        assert [load(b, [k], SIZE, opt(timeout=500)) for k in others] == [(1, 0)] * len(others)
        state = {n["node"]: n["state"] for n in b.report()["cluster"]["nodes"]}
        assert state[f"127.0.0.1:{victim}"] == "open"
        print(f"\nhung node: misses after {[round(t * 1000) for t in times]} ms (deadline "
              f"500 ms; the breaker opens after 2 failures)")
    finally:
        c.kill(victim, signal.SIGCONT)


@pytest.mark.slow
def test_with_a_replica_keys_hit_again_after_failover(make_cluster, make_host):
    c = make_cluster(nodes=3, replicas=1, node_timeout_ms=1000)
    a = make_host(c.seed)
    keys = [PrimaryKey("fo", f"k{i}") for i in range(6)]
    assert save(a, keys, SIZE, opt(write_rcache=False)) == 6
    victim = owner(c, ckey(keys[0]))
    replica = next(n for n in c.nodes if n.primary_port == victim)
    wait_until(lambda: launcher.call(replica.port, "DBSIZE") >= 6, 10.0, "replication")
    c.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    b = make_host(c.seed)
    hit = wait_until(lambda: load(b, keys, SIZE, opt(timeout=500)) == (6, 0), 20.0,
                     "hits after failover", interval_s=0.2)
    assert hit
    print(f"\nfailover: keys of the killed primary hit again {time.monotonic() - t0:.2f} s "
          f"after the SIGKILL (cluster-node-timeout 1000 ms)")


def test_slots_migrated_during_reads(make_cluster, make_host):
    c = make_cluster(nodes=3)
    a, b = make_host(c.seed), make_host(c.seed)
    keys = [PrimaryKey("mig", f"k{i}") for i in range(120)]
    assert save(a, keys, 16 << 10, opt(write_rcache=False)) == 120
    slot = hash_slot(ckey(keys[0]))
    src = owner(c, ckey(keys[0]))
    dst = next(n.port for n in c.primaries if n.port != src)
    ids = {n.port: launcher.call(n.port, "CLUSTER", "MYID").decode() for n in c.primaries}
    results = {"hit": 0, "miss": 0, "wrong": 0, "errors": 0}

    def reader():
        for k in keys:  # each key once: every load goes to the cluster
            try:
                n, wrong = load(b, [k], 16 << 10)
                results["hit" if n else "miss"] += 1
                results["wrong"] += wrong
            except Exception:  # noqa: BLE001 - counted, asserted below
                results["errors"] += 1
            time.sleep(0.002)
    t = threading.Thread(target=reader)
    assert launcher.call(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src]) == "OK"
    assert launcher.call(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst]) == "OK"
    t.start()
    names = [ckey(k) for k in keys]
    for i in range(0, len(names), 4):  # slowly: the reads run while the slot moves
        reply = launcher.call(src, "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS",
                              *names[i:i + 4])
        assert not isinstance(reply, ErrorReply), reply
        time.sleep(0.02)
    for n in c.primaries:
        launcher.call(n.port, "CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
    t.join(30)
    assert not t.is_alive()
    assert results == {"hit": 120, "miss": 0, "wrong": 0, "errors": 0}, results
    assert owner(c, names[0]) == dst
    redirects = b.report()["cluster"]["redirects"]
    print(f"\nmigration: 120 reads while slot {slot} moved: {redirects}")
    assert redirects["ask"] + redirects["moved"] > 0  # the reads did meet the move
    assert load(b, [PrimaryKey("mig", "k0")], 16 << 10) == (1, 0)


def test_the_whole_cluster_down_leaves_the_local_tier_serving(make_cluster, make_host):
    c = make_cluster(nodes=3)
    a = make_host(c.seed)
    local = [f"down-{i}" for i in range(4)]
    assert save(a, local, SIZE) == 4
    # the slot map is loaded (by the write-behind's batch) before the nodes die: the
    # check below is about the breakers of nodes the tier knows, not about a race
    wait_until(lambda: sum(n["slots"] for n in a.report()["cluster"]["nodes"]) == 16384,
               5.0, "the tier's slot map")
    for n in c.nodes:
        c.kill(n.port, signal.SIGKILL)
    times = []
    for i in range(5):
        t0 = time.monotonic()
        assert load(a, local, SIZE, opt(timeout=1000)) == (4, 0)
        assert load(a, [f"never-{i}"], SIZE, opt(timeout=1000)) == (0, 0)
        assert save(a, [f"down-new-{i}"], SIZE) == 1  # local save still works
        times.append(time.monotonic() - t0)
    assert max(times) < 3.0
    rep = a.report()["cluster"]
    assert all(n["state"] != "closed" for n in rep["nodes"]), rep["nodes"]
    print(f"\ncluster down: local hit + remote miss + save per round: "
          f"{min(times) * 1000:.1f}-{max(times) * 1000:.1f} ms")


# ---------------------------------------------------------------- tooling

def test_stats_show_both_tiers_and_every_node(shared_cluster, make_host):
    from ems.stats import format_report
    a, b = make_host(shared_cluster.seed), make_host(shared_cluster.seed)
    assert save(a, ["stats-1", "stats-2"], SIZE, opt(write_rcache=False)) == 2
    assert load(b, ["stats-1", "stats-2"], SIZE) == (2, 0)
    text = format_report(b.report())
    assert "cluster 127.0.0.1:" in text
    lines = text.splitlines()
    assert any(ln.startswith("local ") for ln in lines)
    assert any(ln.startswith("cluster ") and "100.0%" in ln for ln in lines)
    for n in shared_cluster.primaries:
        assert any(ln.startswith(f"127.0.0.1:{n.port}") and "closed" in ln for ln in lines)


def test_cli_up_and_down_start_and_stop_exactly_their_processes(tmp_path):
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(launcher.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(src),
                                                    env.get("PYTHONPATH", "")) if p)
    d = str(tmp_path / "c")
    up = subprocess.run([sys.executable, "-m", "ems", "cluster", "up", "--dir", d,
                         "--nodes", "3"], capture_output=True, text=True, env=env, timeout=60)
    state = None
    try:
        assert up.returncode == 0, up.stderr
        seed = up.stdout.strip().splitlines()[-1]
        assert seed.startswith("valkey://127.0.0.1:")
        with open(os.path.join(d, "cluster.json")) as f:
            state = json.load(f)
        assert state["seed"] == seed and len(state["nodes"]) == 3
        port = state["nodes"][0]["port"]
        assert "cluster_state:ok" in launcher.call(port, "CLUSTER", "INFO").decode()
    finally:
        down = subprocess.run([sys.executable, "-m", "ems", "cluster", "down", "--dir", d],
                              capture_output=True, text=True, env=env, timeout=60)
    assert down.returncode == 0, down.stderr
    assert "stopped 3" in down.stdout
    for n in (state or {}).get("nodes", []):
        assert not launcher._alive(launcher.Node(n["port"], n["pid"], n["role"], n["dir"]))


def test_a_daemon_whose_cluster_never_answers_serves_locally(make_host):
    import socket
    with socket.socket() as s:  # a port nobody listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        a = make_host(f"valkey://127.0.0.1:{port}")
        t0 = time.monotonic()
        assert save(a, ["alone-1"], SIZE) == 1
        assert load(a, ["alone-1"], SIZE) == (1, 0)
        assert load(a, ["alone-2"], SIZE, opt(timeout=1000)) == (0, 0)
        assert save(a, ["alone-3"], SIZE, opt(write_rcache=False, timeout=1000)) == 0
        # the first slot-map refresh runs on a worker: under load it may end after
        # the calls above answered (their misses did not wait for it)
        rep = wait_until(lambda: (r := a.report()["cluster"])["state"] == "down" and r,
                         5.0, "the cluster tier to report down")
        assert "refused" in rep["nodes"][0]["last_error"], rep  # why, in the seed's row
        print(f"\nno cluster: save, local hit, remote miss, write-through refused in "
              f"{(time.monotonic() - t0) * 1000:.1f} ms")


def test_a_password_protected_cluster_needs_the_daemons_password(make_cluster, make_host):
    import os
    pw = "s3cret-\"pass\\word"
    c = make_cluster(nodes=3, password=pw)
    env = dict(os.environ, EMS_CLUSTER_PASSWORD=pw)
    a, b = make_host(c.seed, env=env), make_host(c.seed, env=env)
    stranger = make_host(c.seed)  # no password: the cluster refuses it
    assert save(a, ["auth-1"], SIZE, opt(write_rcache=False)) == 1
    assert load(b, ["auth-1"], SIZE) == (1, 0)
    assert load(stranger, ["auth-1"], SIZE, opt(timeout=1000)) == (0, 0)
    for server in (a.server, b.server):  # never on a command line
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            assert pw.encode() not in f.read()
    for n in c.nodes:
        with open(f"/proc/{n.pid}/cmdline", "rb") as f:
            assert pw.encode() not in f.read()
    assert isinstance(launcher.call(c.nodes[0].port, "PING"), ErrorReply)  # NOAUTH


def test_past_the_write_behind_bound_a_save_stays_local_and_is_counted(shared_cluster,
                                                                       make_host):
    a = make_host(shared_cluster.seed, extra_args=("--cluster-write-behind", "1"))
    b = make_host(shared_cluster.seed)
    assert save(a, ["wb-bound-1", "wb-bound-2"], SIZE) == 2  # local: the call succeeds
    assert load(a, ["wb-bound-1", "wb-bound-2"], SIZE, opt(read_local_only=True)) == (2, 0)
    tier = a.report()["cluster"]["tier"]
    assert tier["write_behind_dropped"] == 2 and tier["writes"] == 0
    assert load(b, ["wb-bound-1"], SIZE) == (0, 0)  # never reached the cluster


def test_the_disk_tier_and_the_cluster_tier_together(shared_cluster, make_host, tmp_path):
    """Lookups go shared memory -> disk -> cluster: a host with a disk keeps what the
    cluster brought it, and after a restart serves it from its disk (also with
    read_local_only) without asking the cluster."""
    a = make_host(shared_cluster.seed)
    disk = str(tmp_path / "disk-b")
    b = make_host(shared_cluster.seed, capacity="8M",
                  extra_args=("--disk", disk, "--disk-checkpoint-s", "0.2"))
    keys = [f"both-{i}" for i in range(12)]  # 12 x 256 KiB
    size = 256 << 10
    assert save(a, keys, size, opt(write_rcache=False)) == 12  # the cluster only
    assert load(b, keys, size) == (12, 0)  # from the cluster; b's disk keeps them
    wait_until(lambda: b.report()["disk"]["objects"] == 12, 20, "b's disk has them")
    cluster_hits = b.report()["cluster"]["tier"]["hits"]
    b.close()
    b.server.restart()
    b2 = Host(b.server)
    try:
        assert load(b2, keys, size, opt(read_local_only=True)) == (12, 0)
        report = b2.report()
        assert report["cluster"]["tier"]["hits"] == 0  # a fresh daemon: none from there
        assert report["tenants"]["(anonymous)"]["tiers"]["disk"]["hits"] == 12
        assert report["disk"]["records_recovered"] == 12 and cluster_hits == 12
        # a key only the cluster has comes after the disk's run
        assert save(a, ["both-late"], size, opt(write_rcache=False)) == 1
        assert load(b2, keys[:2] + ["both-late"], size) == (3, 0)
        assert b2.report()["cluster"]["tier"]["hits"] == 1
    finally:
        b2.close()
