"""Cross-host figures between network namespaces (``ems.testing.netns``), root only.

Two beds of 3 hosts (a Valkey primary and an ems-server each), one after the other:

1. **direct** (clients reach the nodes over the veth path, no relay):
   * the **TCP ceiling** of that path in the same run: one stream host 2 -> host 1,
     and three streams into host 1 from the three namespaces' addresses (what a load
     of host 1 pulls from: its own node and the two others), ``sendall`` of 1 MiB
     buffers into ``recv_into`` a buffer;
   * ``ems bench``'s cross-host rows: ``save`` on host 2 with ``write_rcache=False``
     (returns when the home nodes have the values), ``load`` on host 1 (fresh keys:
     every value comes from the cluster) of BATCH values, per value size, each load
     just after a 3-stream ceiling (the ratio column is the median of load/ceiling
     per repetition: on a shared machine the ceiling itself drifts);
   * 1-key load latency (a cluster hit), p50/p99.
   * **reads during a write to the same node**: a ``ClusterClient`` in host 1's
     namespace sends 64 x 1 MiB SETs to node 2 while another thread GETs one 64 KiB
     value from node 2, with the read and write lanes (the client as it is) and with
     every op on one lane (``lane_of`` patched): what a load behind a write-behind
     costs without the separate read connection.
2. **relay** (clients go through the user-space relay, ``ems.testing.relay``): the
   1-key latency again with the relay idle (its own cost), at 2 ms RTT (1 ms each
   way) and with 5% "loss" (a chunk held back 200 ms, the relay's model of a lost
   segment).

Prints a table and writes JSON (``--out``, default ``docs/netns.json``)::

    sudo PYTHONPATH=src python benchmarks/netns_bench.py [--reps 5] [--samples 300]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from typing import Any

from ems import CcConfig, CcKvOption, KvBufferWrapper
from ems.client.context_caching import ContextCaching
from ems.client.remote import RemoteTransport
from ems.cluster import client as cluster_client
from ems.cluster import value
from ems.cluster.client import ClusterClient, Op
from ems.cluster.topology import parse_url
from ems.testing.netns import NetBed, in_netns, unavailable

SIZES = (64 << 10, 256 << 10, 1 << 20)
BATCH_BYTES = 32 << 20  # per timed call, split into values of one size
LAT_SIZE = 64 << 10
_STREAM_BYTES = 64 << 20
_PORT = 5201


class Sdk:
    def __init__(self, server: Any) -> None:
        self.transport = RemoteTransport.connect(server.socket_path, None, None, 5.0)
        self.cc = ContextCaching(self.transport, CcConfig(rank_id=0, device_id=0,
                                                          model_id="m"), None, tenant="")

    def save(self, keys: list[str], bufs: list[Any], through: bool) -> int:
        w = [[KvBufferWrapper(ctypes.addressof(b), len(b))] for b in bufs]
        return self.cc.save(CcKvOption(timeout=10000, write_rcache=not through), keys,
                            w).success

    def load(self, keys: list[str], bufs: list[Any], timeout_ms: int = 10000) -> int:
        w = [[KvBufferWrapper(ctypes.addressof(b), len(b))] for b in bufs]
        return self.cc.load(CcKvOption(timeout=timeout_ms), keys, w).success

    def close(self) -> None:
        self.cc.close()
        self.transport.close()


def tcp_ceiling(bed: NetBed, senders: list[int], receiver: int) -> float:
    """GB/s of ``len(senders)`` TCP streams into ``receiver`` (each _STREAM_BYTES)."""
    ls = in_netns(bed.ns(receiver), lambda: socket.create_server(
        (bed.addr(receiver), _PORT), backlog=16))
    conns: list[socket.socket] = []

    def accept() -> None:
        for _ in senders:
            conns.append(ls.accept()[0])
    acceptor = threading.Thread(target=accept)
    acceptor.start()
    outs = [in_netns(bed.ns(s), lambda: socket.create_connection(
        (bed.addr(receiver), _PORT))) for s in senders]
    acceptor.join()
    ls.close()
    payload = bytes(1 << 20)

    def send(sock: socket.socket) -> None:
        for _ in range(_STREAM_BYTES >> 20):
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)

    def recv(sock: socket.socket) -> None:
        buf = memoryview(bytearray(1 << 20))
        while sock.recv_into(buf):
            pass
    threads = [threading.Thread(target=send, args=(s,)) for s in outs]
    threads += [threading.Thread(target=recv, args=(c,)) for c in conns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    for s in outs + conns:
        s.close()
    return len(senders) * _STREAM_BYTES / took / 1e9


def cross_host(a: Sdk, b: Sdk, size: int, reps: int, tag: str,
               bed: NetBed) -> dict[str, Any]:
    """save on host 2 (through), load on host 1 (fresh keys): medians in GB/s; before
    each load the 3-stream TCP ceiling into host 1 (this machine's load drifts, so
    each load is set beside a ceiling taken just before it)."""
    n = max(1, BATCH_BYTES // size)
    src = [ctypes.create_string_buffer(bytes([i % 251]) * size, size) for i in range(n)]
    dst = [ctypes.create_string_buffer(size) for _ in range(n)]
    saves, loads, ceilings = [], [], []
    for r in range(reps):
        keys = [f"{tag}-{size}-{r}-{i}" for i in range(n)]
        t0 = time.perf_counter()
        assert a.save(keys, src, through=True) == n
        saves.append(n * size / (time.perf_counter() - t0) / 1e9)
        ceilings.append(tcp_ceiling(bed, [1, 2, 3], 1))
        t0 = time.perf_counter()
        assert b.load(keys, dst) == n
        loads.append(n * size / (time.perf_counter() - t0) / 1e9)
        assert all(d.raw == s.raw for d, s in zip(dst, src))
    return {"value_bytes": size, "batch": n, "save_gbps": statistics.median(saves),
            "load_gbps": statistics.median(loads), "ceiling_gbps": statistics.median(ceilings),
            "load_vs_ceiling": statistics.median(x / c for x, c in zip(loads, ceilings)),
            "save_all": saves, "load_all": loads, "ceiling_all": ceilings}


def latency(a: Sdk, b: Sdk, samples: int, tag: str, bed: NetBed,
            rule: dict[str, Any]) -> dict[str, Any]:
    """1-key cluster-hit loads on host 1 (keys saved through by host 2), ms."""
    keys = [f"{tag}-{i}" for i in range(samples)]
    src = [ctypes.create_string_buffer(b"x" * LAT_SIZE, LAT_SIZE)]
    for k in keys:
        assert a.save([k], src, through=True) == 1
    if rule:
        bed.impair(1, 0, **rule)
    dst = [ctypes.create_string_buffer(LAT_SIZE)]
    took, misses = [], 0
    try:
        for k in keys:
            t0 = time.perf_counter()
            misses += 1 - b.load([k], dst, timeout_ms=2000)
            took.append((time.perf_counter() - t0) * 1000)
    finally:
        if rule:
            bed.impair(1, 0)
    took.sort()
    return {"p50_ms": took[len(took) // 2], "p99_ms": took[int(len(took) * 0.99)],
            "max_ms": took[-1], "samples": samples, "misses": misses}


def read_during_write(bed: NetBed, one_lane: bool, rounds: int) -> dict[str, Any]:
    """GET latency (ms) on node 2 while a 64 x 1 MiB SET batch to node 2 runs."""
    def keys_on_2(prefix: str, n: int) -> list[bytes]:
        out, i = [], 0
        while len(out) < n:
            k = f"{prefix}{{t{i}}}".encode()
            if bed.node_of(k) == 2:
                out.append(k)
            i += 1
        return out
    payload = memoryview(bytearray(1 << 20))
    small = memoryview(bytearray(LAT_SIZE))
    read_key = keys_on_2("rdw-read", 1)[0]
    write_keys = keys_on_2("rdw-write", 64)

    def run() -> dict[str, Any]:
        c = ClusterClient(parse_url(bed.seed))
        try:
            c.run([Op("set", read_key, parts=[value.header(read_key, small), small])],
                  time.monotonic() + 5)
            took, hits = [], 0
            for _ in range(rounds):
                writes = [Op("set", k, parts=[value.header(k, payload), payload])
                          for k in write_keys]
                w = threading.Thread(target=c.run, args=(writes, time.monotonic() + 10))
                w.start()
                time.sleep(0.002)  # the write batch is on the wire
                target = memoryview(bytearray(LAT_SIZE))
                op = Op("get", read_key, target=target, size=LAT_SIZE)
                t0 = time.perf_counter()
                c.run([op], time.monotonic() + 2)
                took.append((time.perf_counter() - t0) * 1000)
                hits += op.ok
                w.join()
            took.sort()
            return {"p50_ms": took[len(took) // 2], "max_ms": took[-1], "hits": hits,
                    "rounds": rounds}
        finally:
            c.close()
    original = cluster_client.lane_of
    if one_lane:
        cluster_client.lane_of = lambda op: cluster_client.READ  # type: ignore[assignment]
    try:
        return in_netns(bed.ns(1), run)
    finally:
        cluster_client.lane_of = original  # type: ignore[assignment]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--out", default="docs/netns.json")
    ns = p.parse_args()
    why = unavailable()
    if why:
        print(f"netns bench: {why}", file=sys.stderr)
        return 1
    out: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(),
                           "kernel": platform.release(), "batch_bytes": BATCH_BYTES,
                           "latency_value_bytes": LAT_SIZE}
    with NetBed(3, relay=False) as bed:
        out["netem"] = bed.netem
        a, b = Sdk(bed.server(2, capacity="512M")), Sdk(bed.server(1, capacity="512M"))
        try:
            out["ceiling_gbps"] = {
                "1_stream_h2_to_h1": statistics.median(
                    tcp_ceiling(bed, [2], 1) for _ in range(3)),
                "3_streams_to_h1": statistics.median(
                    tcp_ceiling(bed, [1, 2, 3], 1) for _ in range(3))}
            out["cross_host"] = [cross_host(a, b, s, ns.reps, "x", bed) for s in SIZES]
            out["latency"] = {"direct 0 ms": latency(a, b, ns.samples, "ld", bed, {})}
            out["read_during_write"] = {
                "two lanes": read_during_write(bed, False, 20),
                "one lane": read_during_write(bed, True, 20)}
        finally:
            a.close()
            b.close()
    with NetBed(3, relay=True) as bed:
        a, b = Sdk(bed.server(2, capacity="512M")), Sdk(bed.server(1, capacity="512M"))
        try:
            for name, rule in (("relay 0 ms", {}), ("relay 2 ms RTT", {"delay_ms": 1.0}),
                               ("relay 5% loss", {"loss": 0.05})):
                out["latency"][name] = latency(a, b, ns.samples, name.replace(" ", ""),
                                               bed, rule)
        finally:
            a.close()
            b.close()
        out["impairment"] = bed.impairment
    c = out["ceiling_gbps"]
    print(f"TCP ceiling on the veth path: 1 stream {c['1_stream_h2_to_h1']:.2f} GB/s, "
          f"3 streams into host 1 {c['3_streams_to_h1']:.2f} GB/s")
    print(f"{'value':>8} {'batch':>6} {'save GB/s':>10} {'load GB/s':>10} "
          f"{'ceiling GB/s':>13} {'load / ceiling':>15}")
    for row in out["cross_host"]:
        print(f"{row['value_bytes'] >> 10:>6}Ki {row['batch']:>6} {row['save_gbps']:>10.2f} "
              f"{row['load_gbps']:>10.2f} {row['ceiling_gbps']:>13.2f} "
              f"{row['load_vs_ceiling']:>14.2f}x")
    print(f"1-key load ({LAT_SIZE >> 10} KiB, a cluster hit on host 1):")
    for name, row in out["latency"].items():
        print(f"  {name:<16} p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  "
              f"max {row['max_ms']:7.2f} ms  misses {row['misses']}/{row['samples']}")
    print("a 64 KiB GET while 64 x 1 MiB SETs go to the same node:")
    for name, row in out["read_during_write"].items():
        print(f"  {name:<10} p50 {row['p50_ms']:7.2f} ms  max {row['max_ms']:7.2f} ms  "
              f"hits {row['hits']}/{row['rounds']}")
    print(out["impairment"])
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
