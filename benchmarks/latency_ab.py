#!/usr/bin/env python3
"""A/B of the 1-key 4 KiB round trip through two daemons started with different flags
(or environments), in one process, rounds alternating A, B, B, A, ...: on a machine
whose speed drifts over minutes, only a side-by-side comparison says which is faster.

    python benchmarks/latency_ab.py --a "--spin-us 0" --b "--spin-us 200"
    python benchmarks/latency_ab.py --b-env EMS_SPIN_US=0        # client-side setting

Prints the median over rounds of each round's p50, per variant and operation. The
daemons live in temp dirs and are stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time

import numpy as np

from ems.bench.systems import EmsSystem
from ems.testing import run_server


def _env(pairs: list[str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in pairs)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="", help="extra ems-server flags of variant A")
    ap.add_argument("--b", default="", help="extra ems-server flags of variant B")
    ap.add_argument("--a-env", action="append", default=[], metavar="K=V",
                    help="client environment of variant A (repeatable)")
    ap.add_argument("--b-env", action="append", default=[], metavar="K=V",
                    help="client environment of variant B (repeatable)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--ops", type=int, default=1500, help="calls per round and operation")
    args = ap.parse_args(argv)
    variants = {"A": (shlex.split(args.a), _env(args.a_env)),
                "B": (shlex.split(args.b), _env(args.b_env))}
    src = np.random.default_rng(0).integers(0, 256, (1, 4096), dtype=np.uint8)
    dst = np.zeros_like(src)
    with contextlib.ExitStack() as stack:
        systems = {}
        for name, (flags, env) in variants.items():
            server = stack.enter_context(run_server(capacity="1G", extra_args=flags))
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # read when the system connects
            try:
                system = EmsSystem("daemon", 1 << 30, socket_dir=server.socket_dir)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            stack.callback(system.close)
            systems[name] = system
        p50s: dict[tuple[str, str], list[float]] = {}
        seq = 0
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                system = systems[name]
                keys = [[f"ab-{seq}-{i}"] for i in range(args.ops)]
                seq += 1
                for op, call, data in (("save", system.save, src), ("load", system.load, dst)):
                    us = []
                    for key in keys:
                        t0 = time.perf_counter_ns()
                        call(key, data)
                        us.append((time.perf_counter_ns() - t0) / 1e3)
                    p50s.setdefault((name, op), []).append(statistics.median(us))
        if not np.array_equal(src, dst):
            raise SystemExit("a load returned other bytes")
    for (name, op), values in sorted(p50s.items()):
        flags, env = variants[name]
        what = " ".join(flags + [f"{k}={v}" for k, v in env.items()]) or "(defaults)"
        print(f"{name} {op}: p50 {statistics.median(values):6.1f} us  "
              f"(rounds {min(values):.0f}-{max(values):.0f})  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
