#!/usr/bin/env python3
"""Cross-host figures of the cluster tier, in one run, on a local 3-primary cluster.

    python benchmarks/cluster_bench.py [--mib 64] [--value-kib 1024] [--rounds 5]
                                       [--json out.json]

Rows (each: GB/s of loading the same set of values into caller memory, median of
rounds; ratio to memcpy):

* memcpy            one copy of the bytes (the bench's limit)
* loopback TCP      one socket stream of the bytes, recv_into a buffer (the ceiling of
                    any client on this host)
* valkey-py         the stock client, pipelined GETs (a ``bytes`` per value), then a
                    copy into the caller's buffer
* ems thin client   ``ems.cluster.client``: pipelined per node, nodes in parallel,
                    recv_into the target, checksum verified
* ems cross-host    host B's daemon loads what host A saved (write_rcache False): the
                    whole SDK path (socket -> B's pool -> caller)

and the V1 routing decision: a 48-block prefix of 256 KiB blocks loaded with each
block on its own slot (spread over the nodes) vs all blocks under one hash tag (one
node). The checksum speeds (XXH3-64 vs zlib.crc32) are printed too.
Every process is started here (127.0.0.1) and stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import zlib
from typing import Any

from ems import CcConfig, CcKvOption, KvBufferWrapper
from ems.cluster import launcher, value
from ems.cluster.client import ClusterClient, Op
from ems.cluster.topology import parse_url


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _median_rate(fn, nbytes: int, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _gbps(nbytes, statistics.median(times))


def memcpy_rate(total: int, rounds: int) -> float:
    src, dst = bytearray(os.urandom(total)), bytearray(total)
    return _median_rate(lambda: dst.__setitem__(slice(None), src), total, rounds)


def loopback_rate(total: int, rounds: int) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    data = memoryview(bytearray(os.urandom(total)))
    go, done = threading.Semaphore(0), threading.Event()

    def server():
        conn, _ = srv.accept()
        while True:
            go.acquire()
            if done.is_set():
                break
            conn.sendall(data)
        conn.close()
    t = threading.Thread(target=server, daemon=True)
    t.start()
    cli = socket.create_connection(srv.getsockname())
    buf = memoryview(bytearray(total))

    def once():
        go.release()
        got = 0
        while got < total:
            got += cli.recv_into(buf[got:])
    try:
        return _median_rate(once, total, rounds)
    finally:
        done.set()
        go.release()
        t.join(5)
        cli.close()
        srv.close()


def valkey_py_rate(seed: str, keys: list[bytes], size: int, rounds: int) -> float:
    try:
        from valkey.cluster import ValkeyCluster
    except ImportError:
        return float("nan")
    host, port = seed.split("://")[1].split(",")[0].split(":")
    vc = ValkeyCluster(host=host, port=int(port))
    bufs = [bytearray(size + value.HEADER) for _ in keys]

    def once():
        pipe = vc.pipeline()
        for k in keys:
            pipe.get(k)
        for b, v in zip(bufs, pipe.execute()):
            b[:] = v
    try:
        return _median_rate(once, len(keys) * size, rounds)
    finally:
        vc.close()


def thin_rate(client: ClusterClient, keys: list[bytes], size: int, rounds: int) -> float:
    bufs = [memoryview(bytearray(size)) for _ in keys]

    def once():
        ops = [Op("get", k, target=b, size=size) for k, b in zip(keys, bufs)]
        client.run(ops, time.monotonic() + 30)
        assert all(op.ok for op in ops)
    return _median_rate(once, len(keys) * size, rounds)


def store(client: ClusterClient, keys: list[bytes], size: int) -> None:
    payload = memoryview(bytearray(os.urandom(size)))
    for i in range(0, len(keys), 16):
        ops = [Op("set", k, parts=[value.header(k, payload), payload]) for k in keys[i:i + 16]]
        client.run(ops, time.monotonic() + 30)
        assert all(op.ok for op in ops)


def cross_host_rate(seed: str, total: int, size: int, rounds: int) -> float:
    from ems.client.context_caching import ContextCaching
    from ems.client.remote import RemoteTransport
    from ems.testing import run_server
    n = total // size
    with contextlib.ExitStack() as stack:
        hosts = []
        for _ in range(2):
            server = stack.enter_context(run_server(capacity=f"{4 * total >> 20}M",
                                                    extra_args=["--cluster", seed]))
            t = RemoteTransport.connect(server.socket_path, None, None, 5.0)
            cc = ContextCaching(t, CcConfig(rank_id=0, device_id=0, model_id="bench"), None)
            stack.callback(t.close)
            stack.callback(cc.close)
            hosts.append(cc)
        a, b = hosts
        src = ctypes.create_string_buffer(os.urandom(size), size)
        dst = [ctypes.create_string_buffer(size) for _ in range(n)]
        opt = CcKvOption(write_rcache=False, timeout=30000)
        rates = []
        for r in range(rounds + 1):
            keys = [f"xh-{r}-{i}" for i in range(n)]
            for i in range(0, n, 8):
                part = keys[i:i + 8]
                got = a.save(opt, part, [[KvBufferWrapper(ctypes.addressof(src), size)]]
                             * len(part))
                assert got.success == len(part)
            t0 = time.perf_counter()
            res = b.load(CcKvOption(timeout=30000), keys,
                         [[KvBufferWrapper(ctypes.addressof(d), size)] for d in dst])
            dt = time.perf_counter() - t0
            assert res.success == n, res
            assert dst[0].raw == src.raw
            if r:  # round 0 warms up
                rates.append(_gbps(n * size, dt))
        return statistics.median(rates)


def routing(client: ClusterClient, rounds: int) -> dict[str, Any]:
    """48 blocks of 256 KiB: each on its own slot vs all under one tag. Rounds
    alternate the order (a drifting machine hurts both alike); per scheme, the median
    GB/s and the largest share of the prefix's bytes one node serves."""
    size, blocks = 256 << 10, 48
    schemes = {"spread": [b"ems:{bench/v1:p:%d}:" % i for i in range(blocks)],
               "one node": [b"ems:{bench/v1:p}:%d" % i for i in range(blocks)]}
    for keys in schemes.values():
        store(client, keys, size)
    bufs = [memoryview(bytearray(size)) for _ in range(blocks)]
    rates: dict[str, list[float]] = {name: [] for name in schemes}
    for r in range(2 * max(rounds, 10)):
        order = list(schemes) if r % 2 else list(schemes)[::-1]
        for name in order:
            ops = [Op("get", k, target=b, size=size) for k, b in zip(schemes[name], bufs)]
            t0 = time.perf_counter()
            client.run(ops, time.monotonic() + 30)
            dt = time.perf_counter() - t0
            assert all(op.ok for op in ops)
            rates[name].append(_gbps(blocks * size, dt))
    out: dict[str, Any] = {}
    for name, keys in schemes.items():
        per_node: dict[Any, int] = {}
        for k in keys:
            node = client.slots.node_of(Op("get", k).slot)
            per_node[node] = per_node.get(node, 0) + 1
        out[name] = {"gbps": statistics.median(rates[name]),
                     "p10": sorted(rates[name])[len(rates[name]) // 10],
                     "p90": sorted(rates[name])[len(rates[name]) * 9 // 10],
                     "nodes": len(per_node),
                     "max_node_share": max(per_node.values()) / blocks}
    return out


def checksums(size: int = 4 << 20) -> dict[str, float]:
    data = memoryview(bytearray(os.urandom(size)))
    return {"xxh3_64": _median_rate(lambda: value.digest(data), size, 20),
            "zlib.crc32": _median_rate(lambda: zlib.crc32(data), size, 20)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="bytes per load (MiB)")
    ap.add_argument("--value-kib", type=int, default=1024, help="value size (KiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    size, total = args.value_kib << 10, args.mib << 20
    n = total // size
    results: dict[str, object] = {"value_bytes": size, "load_bytes": n * size}
    with tempfile.TemporaryDirectory(prefix="ems-cluster-bench-") as d:
        c = launcher.up(d, nodes=3, maxmemory=f"{max(256, 3 * args.mib)}mb")
        client = ClusterClient(parse_url(c.seed))
        try:
            keys = [b"ems:{bench/k%d}:" % i for i in range(n)]
            store(client, keys, size)
            rows = {
                "memcpy": memcpy_rate(n * size, args.rounds),
                "loopback TCP": loopback_rate(n * size, args.rounds),
                "valkey-py pipeline": valkey_py_rate(c.seed, keys, size, args.rounds),
                "ems thin client": thin_rate(client, keys, size, args.rounds),
                "ems cross-host load": cross_host_rate(c.seed, n * size, size, args.rounds),
            }
            results["rows_gbps"] = rows
            results["routing"] = routing(client, args.rounds)
            results["checksum_gbps"] = checksums()
        finally:
            client.close()
            c.stop()
    base = rows["memcpy"]
    print(f"\n{n} values of {size >> 10} KiB ({n * size >> 20} MiB) per load, median of "
          f"{args.rounds} rounds, 3 primaries on 127.0.0.1")
    print(f"{'row':24s} {'GB/s':>7s} {'x memcpy':>9s}")
    for name, rate in rows.items():
        print(f"{name:24s} {rate:7.2f} {rate / base:9.3f}")
    vp = rows["valkey-py pipeline"]
    print(f"ems cross-host / valkey-py: {rows['ems cross-host load'] / vp:.2f}x; "
          f"thin client / valkey-py: {rows['ems thin client'] / vp:.2f}x")
    for name, row in results["routing"].items():  # type: ignore[union-attr]
        print(f"V1 48 x 256 KiB prefix, {name:8s}: {row['gbps']:.2f} GB/s (p10 "
              f"{row['p10']:.2f}, p90 {row['p90']:.2f}) over {row['nodes']} node(s), "
              f"busiest node serves {100 * row['max_node_share']:.0f}% of its bytes")
    cs = results["checksum_gbps"]
    print(f"checksum 4 MiB: xxh3_64 {cs['xxh3_64']:.1f} GB/s, zlib.crc32 "
          f"{cs['zlib.crc32']:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
