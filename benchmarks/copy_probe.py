"""Where does a copy into pool memory lose bandwidth? One kernel, many destinations.

Copies ``--runs`` runs of ``--size`` bytes from a pre-faulted source into each kind of
destination memory, the way the bench's V0 save does, and prints GB/s (median of
``--reps``) and the page faults the timed copies took:

* ``numpy``: a pre-touched numpy array, the same rows every repetition (the bench's
  limit: ``LimitSystem``).
* ``anon``: an anonymous private map touched once (4 KiB pages).
* ``anon-thp``: the same with ``MADV_HUGEPAGE`` (the embedded pool).
* ``memfd``: a ``MAP_SHARED | MAP_POPULATE`` map of a fallocated memfd (the daemon's
  segment as a client maps it; shmem has no huge pages where ``shmem_enabled`` is
  ``never``).

and for each, ``same`` (the same rows every repetition) or ``moving`` (the next rows
of a destination ``--pool`` bytes large each repetition, as fresh pool extents are).
Kernels: ``nt`` (ems._native streaming stores), ``glibc`` (ctypes.memmove).
``--v1 BLOCK_SIZE`` instead copies V1's runs (a block of each of 64 cache tensors to
pool-like memory) in the order the mover used before (tensor by tensor), object by
object, and sorted by cache address (the save's source), each way.

    PYTHONPATH=src python benchmarks/copy_probe.py [--size 1048576 --runs 64] [--load]
    PYTHONPATH=src python benchmarks/copy_probe.py --v1 16
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import statistics
import sys
import time

import numpy as np


def _addr(mm: mmap.mmap) -> tuple[int, object]:
    buf = (ctypes.c_char * len(mm)).from_buffer(mm)
    return ctypes.addressof(buf), buf


def destinations(pool: int) -> dict[str, tuple[int, object]]:
    out: dict[str, tuple[int, object]] = {}
    arr = np.empty(pool, np.uint8)
    arr.fill(1)
    out["numpy"] = (arr.ctypes.data, arr)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    plain = mmap.mmap(-1, pool, flags=flags)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        plain.madvise(mmap.MADV_NOHUGEPAGE)
    a, keep = _addr(plain)
    ctypes.memset(a, 1, pool)
    out["anon"] = (a, (plain, keep))
    thp = mmap.mmap(-1, pool, flags=flags)
    thp.madvise(mmap.MADV_HUGEPAGE)
    a, keep = _addr(thp)
    ctypes.memset(a, 1, pool)
    out["anon-thp"] = (a, (thp, keep))
    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, pool)
    os.posix_fallocate(fd, 0, pool)
    shm = mmap.mmap(fd, pool, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    os.close(fd)
    a, keep = _addr(shm)
    out["memfd"] = (a, (shm, keep))
    return out


def v1_orders(block_size: int, tokens: int, reps: int) -> None:
    """V1's runs (a block of each of 64 cache tensors, randomly chosen blocks) copied
    by the native helper into pool-like memory in three orders."""
    import torch

    from ems.client import native
    tensors = 64
    n_blk = tokens // block_size
    nb = n_blk + n_blk // 4 + 1
    kv = [torch.ones((nb, block_size, 8, 128), dtype=torch.float16) for _ in range(tensors)]
    blocks = torch.randperm(nb, generator=torch.Generator().manual_seed(0))[:n_blk]
    run = block_size * 8 * 128 * 2
    total = run * tensors * n_blk
    print(f"V1: {n_blk} objects x {tensors} runs of {run >> 10} KiB = {total >> 20} MiB, "
          f"best of {reps}; GB/s save / load")
    for dname, (base, _keep) in destinations(total).items():
        if dname == "anon":
            continue
        cache = torch.stack([t.data_ptr() + blocks * t.stride(0) * 2 for t in kv])  # [T, n]
        pool = base + torch.arange(n_blk)[None, :] * run * tensors + \
            torch.arange(tensors)[:, None] * run
        orders = {"tensor by tensor (before)": (pool.reshape(-1), cache.reshape(-1)),
                  "object by object": (pool.T.reshape(-1), cache.T.reshape(-1))}
        by_cache = torch.argsort(cache.reshape(-1))
        orders["sorted by cache address"] = (pool.reshape(-1)[by_cache],
                                             cache.reshape(-1)[by_cache])
        cells = []
        for oname, (p, c) in orders.items():
            p, c = p.contiguous(), c.contiguous()
            rates = []
            for dst, src in ((p, c), (c, p)):
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    native.copy_runs(dst, src, run)
                    best = min(best, time.perf_counter() - t0)
                rates.append(total / best / 1e9)
            cells.append(f"{oname}: {rates[0]:.1f} / {rates[1]:.1f}")
        print(f"  into {dname:8} " + " | ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--runs", type=int, default=64)
    ap.add_argument("--pool", type=int, default=256 << 20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--load", action="store_true", help="copy out of the destination")
    ap.add_argument("--misalign", type=int, default=0,
                    help="bytes added to every destination address (pool extents are "
                         "64-byte aligned: try 64, 16, 8)")
    ap.add_argument("--v1", type=int, metavar="BLOCK_SIZE",
                    help="instead: V1's runs of this block size in three orders")
    ap.add_argument("--tokens", type=int, default=1024, help="V1 prefix tokens")
    args = ap.parse_args()
    if args.v1:
        v1_orders(args.v1, args.tokens, args.reps)
        return 0
    from ems.client import native
    kernels = {"glibc": ctypes.memmove}
    if native.copy_one is not None:
        kernels["nt"] = native.copy_one
    batch = args.size * args.runs
    src = np.empty(batch, np.uint8)
    src.view(np.uint64)[:] = np.arange(batch // 8, dtype=np.uint64)
    s0 = src.ctypes.data
    dests = destinations(args.pool + args.misalign)
    print(f"{args.runs} runs x {args.size} B ({'load' if args.load else 'save'}), "
          f"pool {args.pool >> 20} MiB, destination +{args.misalign} B, median of {args.reps}")
    print(f"{'dest':10} {'where':7} " + " ".join(f"{k + ' GB/s':>10} {'faults':>7}"
                                                for k in kernels))
    for dname, (base, _keep) in dests.items():
        for where in ("same", "moving"):
            cells = []
            for fn in kernels.values():
                times, faults = [], 0
                for rep in range(args.reps + 1):
                    off = 0 if where == "same" else (rep * batch) % (args.pool - batch + 1)
                    d0 = base + off + args.misalign
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t0 = time.perf_counter()
                    for i in range(args.runs):
                        if args.load:
                            fn(s0 + i * args.size, d0 + i * args.size, args.size)
                        else:
                            fn(d0 + i * args.size, s0 + i * args.size, args.size)
                    dt = time.perf_counter() - t0
                    if rep:
                        times.append(dt)
                        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                cells.append(f"{batch / statistics.median(times) / 1e9:10.2f} "
                             f"{faults // args.reps:7d}")
            print(f"{dname:10} {where:7} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
