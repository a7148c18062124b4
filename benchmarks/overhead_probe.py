"""What a save or load costs besides copying bytes: the copy switched off, the rest timed.

Runs ems's V0 (``--keys`` values of ``--value-kib``) and V1 (32 layers x K,V fp16,
``--block-size``, ``--tokens``) saves and loads on the embedded pool (or through a
fresh ``ems-server`` with ``--pool daemon``) with the native copy and ``copy_bytes``
replaced by no-ops, and prints per call:

* ``warm`` / ``cold``: best and median milliseconds, with the caches as the last
  call left them, and after reading 64 MiB (what a real copy's source reads do to a
  32 MiB L3);
* ``worker ticks``: CPU time taken meanwhile by the process's other threads (torch's
  intra-op workers: ops that run on them make a call wait for a preempted worker on a
  busy host, and the workers spin while the call goes on).

    PYTHONPATH=src python benchmarks/overhead_probe.py [--pool daemon] [--block-size 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable


def _other_ticks() -> int:
    total, me = 0, os.getpid()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def _measure(label: str, call: Callable[[int], None], sweep: Callable[[], None],
             reps: int) -> None:
    out = {"warm": [], "cold": []}
    ticks = _other_ticks()
    for r in range(2 * reps + 2):
        mode = "cold" if r % 2 else "warm"
        if mode == "cold":
            sweep()
        t0 = time.perf_counter()
        call(r)
        if r >= 2:
            out[mode].append(time.perf_counter() - t0)
    ticks = _other_ticks() - ticks
    cells = [f"{m} best {min(v) * 1e3:.3f} median {statistics.median(v) * 1e3:.3f} ms"
             for m, v in out.items()]
    print(f"{label:34} " + " | ".join(cells) + f" | worker ticks {ticks}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", choices=("embedded", "daemon"), default="embedded")
    ap.add_argument("--value-kib", type=int, default=1024)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)

    import torch

    from ems.bench.systems import ems_pool, touched
    from ems.bench.workloads import _v1_cache
    from ems.client import copy as ems_copy
    from ems.client import native

    capacity = 512 << 20
    with ems_pool(args.pool, capacity, "ems-overhead-") as system:
        size, n = args.value_kib << 10, args.keys
        src = touched(size * n).reshape(n, size)
        dst = touched(size * n).reshape(n, size)
        system.warm(src, capacity)
        flush = touched(64 << 20)

        def sweep() -> None:
            flush.sum()

        ems_copy.copy_bytes = lambda *a: None  # the copies are what we do not time
        native._fn = (lambda *a: None) if native._fn is not None else None
        print(f"{args.pool}: per call, the copy switched off")
        _measure(f"V0 save {n} x {args.value_kib} KiB",
                 lambda r: system.save([f"o{r}-{i}" for i in range(n)], src), sweep,
                 args.reps)
        system.save([f"l-{i}" for i in range(n)], src)
        _measure(f"V0 load {n} x {args.value_kib} KiB",
                 lambda r: system.load([f"l-{i}" for i in range(n)], dst), sweep, args.reps)

        bs = args.block_size
        n_blk = args.tokens // bs
        nb = n_blk + n_blk // 4 + 1
        kv = _v1_cache(torch, 32, nb, bs)
        system.cc.register_kvcache(kv)
        blocks = torch.randperm(nb, generator=torch.Generator().manual_seed(0))[:n_blk]
        slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1).tolist()
        offsets = [bs] * n_blk
        cc, option = system.cc, system.option
        _measure(f"V1 save block {bs}, {args.tokens} tok",
                 lambda r: cc.save(slots, [r * 10**6 + i for i in range(n_blk)], offsets,
                                   option=option), sweep, args.reps)
        held = [7 * 10**8 + i for i in range(n_blk)]
        cc.save(slots, held, offsets, option=option)

        def load_v1(_r: int) -> None:
            res = cc.load(slots, held, offsets, option=option)
            if res.success != res.total:
                raise RuntimeError(f"V1 load found {res.success}/{res.total}")
        _measure(f"V1 load block {bs}, {args.tokens} tok", load_v1, sweep, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
