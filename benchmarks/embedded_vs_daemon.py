#!/usr/bin/env python3
"""Save/load GB/s of the embedded pool and of ems-server, against a memcpy of the same
bytes in the same run. Prints a table and writes JSON.

    python benchmarks/embedded_vs_daemon.py                   # 128 MiB per request
    python benchmarks/embedded_vs_daemon.py --total-mib 256 --rounds 7 --inflight 4

Every request is V0: ``total / value`` keys, each value in two host buffers (K and V
of one block), through the public API (``cc.save`` / ``cc.load``). ``memcpy`` copies
the same buffers with the same calls (``ctypes.memmove`` per buffer) between two warm
host buffers. The pool is twice the working set, and the first rounds are warm-up, so
the measured saves write into pages the pool has touched before (as in steady
state) and every load hits. ``--inflight N`` splits each round into N concurrent
async requests (the way engines submit them). It also reports the median latency of
saving and of loading one 4 KiB key (the per-request cost: two round trips to the
daemon for a save, one plus a one-way release for a load).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

from ems import CcConfig, CcKvOption, Ems, EmsConfig, KvBufferWrapper
from ems.testing import run_server

SMALL_OPS = 300


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class Workload:
    def __init__(self, total: int, value: int) -> None:
        self.value = value
        self.n_keys = total // value
        self.total = self.n_keys * value
        half = value // 2
        self.src = ctypes.create_string_buffer(self.total)
        self.dst = ctypes.create_string_buffer(self.total)
        ctypes.memset(self.src, 0x3C, self.total)  # touch every page once
        ctypes.memset(self.dst, 0, self.total)
        self.parts = []  # (offset, length) of the buffers of each key
        for k in range(self.n_keys):
            base = k * value
            self.parts.append([(base, half), (base + half, value - half)])

    def wrappers(self, buf) -> list[list[KvBufferWrapper]]:
        addr = ctypes.addressof(buf)
        return [[KvBufferWrapper(addr + off, n) for off, n in key] for key in self.parts]

    def memcpy(self) -> float:
        src, dst = ctypes.addressof(self.src), ctypes.addressof(self.dst)
        t0 = time.perf_counter()
        for key in self.parts:
            for off, n in key:
                ctypes.memmove(dst + off, src + off, n)
        return time.perf_counter() - t0


def run_pool(work: Workload, rounds: int, warmup: int, inflight: int) -> dict[str, list[float]]:
    """Time save and load rounds on the pool ``Ems.init`` picks from the environment."""
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="bench")))
    cc = Ems.get_cc()
    option = CcKvOption(timeout=0)
    src, dst = work.wrappers(work.src), work.wrappers(work.dst)
    step = -(-work.n_keys // inflight)
    chunks = [(i, min(i + step, work.n_keys)) for i in range(0, work.n_keys, step)]
    times: dict[str, list[float]] = {"save": [], "load": []}
    try:
        for r in range(warmup + rounds):
            keys = [f"r{r}-k{k}" for k in range(work.n_keys)]  # write-once: new keys
            for op, values in (("save", src), ("load", dst)):
                call: Callable = cc.async_save if op == "save" else cc.async_load
                t0 = time.perf_counter()
                futs = [call(option, keys[a:b], values[a:b]) for a, b in chunks]
                done = sum(f.result().success for f in futs)
                elapsed = time.perf_counter() - t0
                if done != work.n_keys:
                    raise SystemExit(f"{op} stored/hit {done} of {work.n_keys} keys")
                if r >= warmup:
                    times[op].append(elapsed)
        if work.dst.raw[:64] != work.src.raw[:64]:
            raise SystemExit("load returned wrong bytes")
        # Per-request cost: one 4 KiB key, saved then loaded, many times.
        small_src, small_dst = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(4096)
        one = [[KvBufferWrapper(ctypes.addressof(small_src), 4096)]]
        into = [[KvBufferWrapper(ctypes.addressof(small_dst), 4096)]]
        for op in ("save_4k", "load_4k"):
            times[op] = []
        for i in range(SMALL_OPS):
            for op, values in (("save_4k", one), ("load_4k", into)):
                call = cc.save if op == "save_4k" else cc.load
                t0 = time.perf_counter()
                call(option, [f"small{i}"], values)
                times[op].append(time.perf_counter() - t0)
    finally:
        Ems.finalize()
    return times


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=128, help="bytes per round (MiB)")
    p.add_argument("--value-kib", type=int, default=1024, help="bytes per key (KiB)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (median)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    p.add_argument("--inflight", type=int, default=1, help="concurrent requests per round")
    p.add_argument("--json", default="bench-results/embedded_vs_daemon.json",
                   help="where to write the results")
    args = p.parse_args(argv)

    work = Workload(args.total_mib << 20, args.value_kib << 10)
    capacity = 2 * work.total + (16 << 20)
    os.environ["EMS_CAPACITY"] = str(capacity)
    os.environ["EMS_WORKERS"] = str(max(4, args.inflight))

    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.warmup):
        work.memcpy()
    results["memcpy"] = {"copy": [work.memcpy() for _ in range(args.rounds)]}
    os.environ["EMS_POOL"] = "embedded"
    results["embedded"] = run_pool(work, args.rounds, args.warmup, args.inflight)
    with run_server(capacity=str(capacity)) as server:
        os.environ.update(server.client_env())
        results["daemon"] = run_pool(work, args.rounds, args.warmup, args.inflight)
    results["memcpy (again)"] = {"copy": [work.memcpy() for _ in range(args.rounds)]}

    base = gbps(work.total, statistics.median(results["memcpy"]["copy"] +
                                              results["memcpy (again)"]["copy"]))
    rows = []
    latency_us = {}
    for system, ops in results.items():
        for op, times in ops.items():
            if op.endswith("_4k"):
                latency_us.setdefault(system, {})[op] = round(statistics.median(times) * 1e6, 1)
                continue
            rate = gbps(work.total, statistics.median(times))
            rows.append({"system": system, "op": op, "gb_per_s": round(rate, 3),
                         "best_gb_per_s": round(gbps(work.total, min(times)), 3),
                         "vs_memcpy": round(rate / base, 3)})
    print(f"{work.n_keys} keys x {work.value >> 10} KiB = {work.total >> 20} MiB per round, "
          f"{args.inflight} request(s) in flight, median of {args.rounds} rounds")
    print(f"{'system':<16}{'op':<6}{'GB/s':>8}{'best':>8}{'vs memcpy':>11}")
    for r in rows:
        print(f"{r['system']:<16}{r['op']:<6}{r['gb_per_s']:>8.2f}{r['best_gb_per_s']:>8.2f}"
              f"{r['vs_memcpy']:>10.0%}")
    for system, ops in latency_us.items():
        print(f"{system:<16}one 4 KiB key, median of {SMALL_OPS}: save {ops['save_4k']:.0f} us, "
              f"load {ops['load_4k']:.0f} us")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"params": vars(args) | {"keys": work.n_keys, "bytes": work.total},
                   "host": {"python": sys.version.split()[0], "machine": platform.machine(),
                            "cpus": os.cpu_count()},
                   "memcpy_gb_per_s": round(base, 3), "rows": rows,
                   "latency_us": latency_us,
                   "raw_seconds": results}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
