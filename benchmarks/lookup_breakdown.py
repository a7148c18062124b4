#!/usr/bin/env python3
"""Where a prefix lookup's time goes through ``ems-server``: ``exists`` and ``load`` of
n keys of 16 KiB, for n in 1, 8, 24 and 64, as wall time, the client thread's CPU time
and the daemon's CPU time per call, and the copy of the same bytes alone.

    python benchmarks/lookup_breakdown.py                 # table, lookup_breakdown.json
    python benchmarks/lookup_breakdown.py --out DIR --calls 3000

A lookup is ``exists`` then ``load`` (two round trips: an engine asks at scheduling
time and loads later). The slope over n is the per-key work of each side; the value at
n = 1 is the round trip's fixed cost. Polling is off on both sides (``EMS_SPIN_US=0``,
``ems-server --spin-us 0``) so that CPU time is work, not waiting; the wall times are
then a little above those of the default settings (a wake-up per reply). The copy
rows copy the same 16 KiB runs between two buffers: numpy (one call) and ems's own
copy (``ems.client.copy.copy_bytes``, one call per key, as a load does).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

os.environ["EMS_SPIN_US"] = "0"  # (read when the client connects)

from ems import KvBufferWrapper  # noqa: E402
from ems.bench.disk import _cpu_s  # noqa: E402
from ems.bench.systems import EmsSystem, touched  # noqa: E402
from ems.client import copy as _copy  # noqa: E402
from ems.testing import run_server  # noqa: E402

BLOCK = 16 << 10
COUNTS = (1, 8, 24, 64)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1500, help="calls per case")
    ap.add_argument("--out", default=".", help="directory for lookup_breakdown.json")
    args = ap.parse_args(argv)
    top = max(COUNTS)
    src = touched(top * BLOCK).reshape(top, BLOCK)
    dst = touched(top * BLOCK).reshape(top, BLOCK)
    src[:] = 5
    rows = []
    with run_server(capacity="256M", extra_args=["--spin-us", "0"]) as server:
        system = EmsSystem("daemon", 256 << 20, socket_dir=server.socket_dir)
        try:
            keys = [f"k{i}" for i in range(top)]
            system.save(keys, src)
            vals = [[KvBufferWrapper(dst.ctypes.data + i * BLOCK, BLOCK)] for i in range(top)]
            assert server.proc is not None
            cc, opt, pid = system.cc, system.option, server.proc.pid
            gc.disable()
            for n in COUNTS:
                k, v = keys[:n], vals[:n]
                cases = (("exists", lambda k=k: cc.exists(k, opt)),
                         ("load", lambda k=k, v=v: cc.load(opt, k, v)))
                for op, call in cases:
                    for _ in range(100):
                        call()
                    d0, c0, t0 = _cpu_s(pid), time.thread_time(), time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    t1, c1, d1 = time.perf_counter(), time.thread_time(), _cpu_s(pid)
                    rows.append({"op": op, "keys": n,
                                 "wall_us": (t1 - t0) / args.calls * 1e6,
                                 "client_cpu_us": (c1 - c0) / args.calls * 1e6,
                                 "daemon_cpu_us": (d1 - d0) / args.calls * 1e6})
            gc.enable()
            if not np.array_equal(dst, src):
                raise RuntimeError("the loads returned other bytes")
        finally:
            system.close()
    copies = {}
    pairs = [(dst.ctypes.data + i * BLOCK, src.ctypes.data + i * BLOCK) for i in range(24)]
    copy_bytes = _copy.copy_bytes
    for name, call in (("numpy", lambda: np.copyto(dst[:24], src[:24])),
                       ("ems copy_bytes", lambda: [copy_bytes(d, s, BLOCK)
                                                   for d, s in pairs])):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        copies[name] = (time.perf_counter() - t0) / args.calls * 1e6
    print("| op | keys | wall µs | client CPU µs | daemon CPU µs |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['keys']} | {r['wall_us']:.1f} | {r['client_cpu_us']:.1f} | "
              f"{r['daemon_cpu_us']:.1f} |")
    for op in ("exists", "load"):
        a = next(r for r in rows if r["op"] == op and r["keys"] == COUNTS[0])
        b = next(r for r in rows if r["op"] == op and r["keys"] == COUNTS[-1])
        span = COUNTS[-1] - COUNTS[0]
        print(f"{op}: per key {(b['wall_us'] - a['wall_us']) / span:.2f} µs wall, "
              f"{(b['client_cpu_us'] - a['client_cpu_us']) / span:.2f} client CPU, "
              f"{(b['daemon_cpu_us'] - a['daemon_cpu_us']) / span:.2f} daemon CPU")
    print("copy of 24 x 16 KiB: " + ", ".join(f"{k} {v:.1f} µs" for k, v in copies.items()))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "lookup_breakdown.json")
    with open(path, "w") as f:
        json.dump({"block_bytes": BLOCK, "calls": args.calls, "rows": rows,
                   "copy_24_us": copies, "loadavg": os.getloadavg()[0]}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
