#!/usr/bin/env python3
"""Where does an ems save/load spend its time? A phase breakdown, and optionally a
py-spy flame graph, of the paths ``ems bench`` measures.

    python benchmarks/profile_ems.py                     # embedded pool
    python benchmarks/profile_ems.py --pool daemon       # through a fresh ems-server
    python benchmarks/profile_ems.py --py-spy out.svg    # + flame graph (pip install py-spy)

Phases (summed over all calls, per call in microseconds): ``normalize`` (validation,
in the caller), ``queue`` (submit -> a worker starts it), ``save``/``load`` (the
transport's verbs, whole), and the steps inside them: ``_save_leased``/``_put`` (a small
save through the daemon's lease: cut, copy, Put), ``_reserve``/``_commit`` (the
two-phase save: a lock in-process, a round trip to the daemon), ``_pin`` (a load's
Acquire), ``copy`` (the mover, also counted in its verb), ``wake`` (the worker finished
-> the caller returns). It wraps the SDK's methods at run time; it changes no SDK file.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from ems.bench.systems import EmsSystem, ems_pool

_acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
_lock = threading.Lock()


def _add(phase: str, seconds: float) -> None:
    with _lock:
        a = _acc[phase]
        a[0] += seconds
        a[1] += 1


def _wrap(obj: Any, name: str, phase: str) -> None:
    fn = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(phase, time.perf_counter() - t0)
    setattr(obj, name, timed)


def instrument(system: EmsSystem) -> None:
    from ems.client import layout, movers
    cc, tr = system.cc, system.transport
    _wrap(cc, "_normalize", "normalize")
    # the verbs, and the steps inside them (the daemon's; the embedded pool has
    # _reserve/_commit only)
    for name in ("save", "load", "_save_leased", "_put", "_reserve", "_commit", "_pin"):
        if hasattr(tr, name):
            _wrap(tr, name, name)
    for cls, names in ((movers.V0Mover, ("to_pool", "from_pool")),
                       (layout.V1Mover, ("to_pool", "from_pool"))):
        for n in names:
            if not getattr(getattr(cls, n), "_ems_profiled", False):
                orig = getattr(cls, n)

                def timed(self: Any, *a: Any, _orig: Callable = orig, **k: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return _orig(self, *a, **k)
                    finally:
                        _add("copy", time.perf_counter() - t0)
                timed._ems_profiled = True  # type: ignore[attr-defined]
                setattr(cls, n, timed)
    submit, execute = cc._submit, cc._execute
    marks: dict[int, float] = {}

    def _submit(req: Any) -> Any:
        marks[id(req)] = time.perf_counter()
        return submit(req)

    def _execute(task: Any, req: Any, spin: bool = False) -> None:
        t0 = time.perf_counter()
        _add("queue", t0 - marks.pop(id(req), t0))
        execute(task, req, spin)
        task._ems_done = time.perf_counter()

    cc._submit, cc._execute = _submit, _execute
    for op in ("save", "load"):
        orig = getattr(cc, f"async_{op}")

        def call(*a: Any, _orig: Callable = orig, **k: Any) -> Any:
            fut = _orig(*a, **k)
            r = fut.result()
            done = getattr(fut._task, "_ems_done", None) if hasattr(fut, "_task") else None
            if done is not None:
                _add("wake", time.perf_counter() - done)
            return r
        setattr(cc, op, call)


def report(title: str, calls: int, wall: float) -> None:
    print(f"\n{title}: {calls} calls, {wall / calls * 1e6:.1f} us per call (wall)")
    for phase in ("normalize", "queue", "save", "load", "_save_leased", "_put", "_reserve",
                  "_commit", "_pin", "copy", "wake"):
        if phase in _acc:
            total, n = _acc[phase]
            print(f"  {phase:10s} {total / calls * 1e6:9.1f} us/call  ({n} calls, "
                  f"{total / wall * 100:5.1f}% of wall)")
    _acc.clear()


def run(system: EmsSystem, args: argparse.Namespace) -> None:
    size, n = args.value_bytes, args.keys
    src = np.arange(n * size // 8, dtype=np.uint64).view(np.uint8).reshape(n, size)
    dst = np.empty_like(src)
    dst.fill(1)  # fault its pages in now, not inside the first timed load
    system.warm(src, system.capacity_bytes)
    _acc.clear()
    reps = max(1, min(args.reps, system.capacity_bytes // src.nbytes - 1))  # no eviction
    for op in ("save", "load"):
        t0 = time.perf_counter()
        for rep in range(reps):
            keys = [f"p-{rep}-{i}" for i in range(n)]
            getattr(system, op)(keys, src if op == "save" else dst)
        wall = time.perf_counter() - t0
        report(f"V0 {op} {n} x {size >> 10} KiB ({n * size * reps / wall / 1e9:.2f} GB/s)",
               reps, wall)
    one = np.zeros((1, 4096), np.uint8)
    for op in ("save", "load"):
        t0 = time.perf_counter()
        for i in range(args.latency_ops):
            getattr(system, op)([f"l-{i}"], one)
        report(f"1 key 4 KiB {op}", args.latency_ops, time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", choices=("embedded", "daemon"), default="embedded")
    ap.add_argument("--value-bytes", type=int, default=1 << 20)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--latency-ops", type=int, default=2000)
    ap.add_argument("--capacity", type=int, default=512 << 20)
    ap.add_argument("--py-spy", metavar="SVG", help="also record a py-spy flame graph")
    args = ap.parse_args(argv)
    if args.py_spy:
        if shutil.which("py-spy") is None:
            print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
            return 2
        rest = [a for a in argv if a != "--py-spy" and a != args.py_spy]
        return subprocess.call(["py-spy", "record", "--threads", "-r", "1000", "-o",
                                args.py_spy, "--", sys.executable, __file__, *rest])
    with ems_pool(args.pool, args.capacity, "ems-profile-") as system:
        instrument(system)
        run(system, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
