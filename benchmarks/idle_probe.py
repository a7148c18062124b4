"""What idle time does to a warm pool: saves before and after the pool sat unused.

On a VM whose host takes back guest memory left idle, the first passes over a warm
pool after a pause run at page-fault speed although the guest counts no fault and its
RSS does not change (the faults are the host's). This probe shows it: a warm pool
(written once whole), ``--saves`` saves of ``--keys`` x ``--value-kib`` new keys
(each evicts the oldest: the saves walk the pool), then the same after each pause of
``--idle`` seconds. It prints a table (GB/s per save, the guest's minor faults and
RSS) and writes ``--out`` (JSON).

    PYTHONPATH=src python benchmarks/idle_probe.py [--pool daemon] [--idle 20,60]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", choices=("embedded", "daemon"), default="embedded")
    ap.add_argument("--capacity-mib", type=int, default=1024)
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--value-kib", type=int, default=1024)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--idle", default="20,60", help="comma list of pauses in seconds")
    ap.add_argument("--out", default="idle_probe.json")
    args = ap.parse_args(argv)
    from ems.bench.systems import ems_pool

    size, n = args.value_kib << 10, args.keys
    rows: list[dict] = []
    with ems_pool(args.pool, args.capacity_mib << 20) as system:
        src = np.empty((n, size), np.uint8)
        src.fill(5)
        system.warm(src, args.capacity_mib << 20)
        for idle in [0.0] + [float(x) for x in args.idle.split(",") if x]:
            time.sleep(idle)
            for i in range(args.saves):
                keys = [f"i{idle}-{i}-{k}" for k in range(n)]
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                system.save(keys, src)
                dt = time.perf_counter() - t0
                rows.append({"idle_s": idle, "save": i, "gbps": n * size / dt / 1e9,
                             "guest_minor_faults":
                                 resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
                             "rss_kib": _rss_kib()})
    print(f"| idle before (s) | save | GB/s | guest minor faults | RSS KiB |  "
          f"({args.pool}, {n} x {args.value_kib} KiB)")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['idle_s']:.0f} | {r['save']} | {r['gbps']:.1f} | "
              f"{r['guest_minor_faults']} | {r['rss_kib']} |")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
