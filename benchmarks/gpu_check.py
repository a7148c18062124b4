"""The GPU data path on a real GPU: bit-exact, as fast as a pinned torch copy, no stall.

One short run (a few minutes on one H200) against an ``ems-server`` it starts (unix
socket in a temp dir, stopped by PID):

1. **exact**: V1 caches of a Llama-8B-like shape (32 layers, K and V of 8 KV heads x
   128, block 16), fp16 and bf16, saved from some blocks and loaded into others,
   both V1 semantics (slot_mapping, chunk_descs); V0 device buffers; bit for bit.
2. **throughput**: save (GPU -> pool) and load (pool -> GPU) GB/s at runs of 64 KiB,
   512 KiB and 2 MiB -- V1 pool objects of 1, 8 and 32 layers of that shape, V0 keys of
   one device buffer of that size -- against, in the same run, a torch copy of the
   same bytes in the same runs to pinned host memory (``pin_memory=True``), to
   pageable host memory, and one bulk pinned copy (the link).
3. **stall**: a matmul loop on the engine's stream, timed with CUDA events, alone and
   while a thread saves V1 blocks (ratio; the target is <= 1.10).

Prints a table and, with ``--json PATH``, writes the figures (``docs/bench-gpu.json``
is what ``scripts/bench_tables.py`` renders on the benchmarks page). Without CUDA it
prints one line and exits 0.

    pip install --no-deps -e . && python benchmarks/gpu_check.py --json docs/bench-gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any, Callable, Optional

from ems.bench.gpu import gpu_table

LAYERS, HEADS, HEAD, BLOCK = 32, 8, 128, 16
#: bytes of one layer's K (or V) block: 16 x 8 x 128 x 2 = 32 KiB
TENSOR_BLOCK = BLOCK * HEADS * HEAD * 2
RUNS = (64 << 10, 512 << 10, 2 << 20)


def no_cuda_reason() -> Optional[str]:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


class Check:
    """The pool (a started ems-server, Ems.init'ed with V0 and V1 configs) and helpers."""

    def __init__(self, torch: Any, total_bytes: int, reps: int) -> None:
        self.torch = torch
        self.total = total_bytes
        self.reps = reps
        self.hash = 1 << 40  # fresh hashes: a save of a stored key copies nothing
        from ems import Ems
        cc = Ems.get_cc()
        assert cc is not None
        self.cc = cc

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.hash, self.hash + n))
        self.hash += n
        return out

    def caches(self, layers: int, blocks: int, dtype: Any) -> list[list[Any]]:
        t = self.torch
        return [[t.randn(blocks, BLOCK, HEADS, HEAD, device="cuda").to(dtype)
                 for _ in range(2)] for _ in range(layers)]

    def timed(self, fn: Callable[[], None]) -> float:
        """Best of ``reps`` wall times of ``fn`` (seconds), the device idle before."""
        best = float("inf")
        for _ in range(self.reps):
            self.torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            self.torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best


def wait_registered(timeout_s: float = 120.0) -> dict[str, Any]:
    from ems.client import pinning
    t0 = time.perf_counter()
    while pinning.statistics().registering and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.05)
    s = pinning.statistics()
    return {"seconds": round(time.perf_counter() - t0, 2), "registered_bytes": s.registered_bytes,
            "refusals": s.refusals, "pageable_bytes": s.pageable_bytes,
            "still_registering": s.registering}


def bits(t: Any) -> Any:
    """The bytes of ``t`` (compares below are bitwise: NaN patterns included)."""
    import torch
    return t.contiguous().view(-1).view(torch.uint8)


def exact(check: Check) -> dict[str, bool]:
    torch, cc = check.torch, check.cc
    from ems import CcKvOption, KvBufferWrapper
    out: dict[str, bool] = {}
    for name in ("float16", "bfloat16"):
        dtype = getattr(torch, name)
        kv = check.caches(LAYERS, 96, dtype)
        cc.register_kvcache(kv)
        ref = [[x.clone() for x in layer] for layer in kv]
        n = 24
        hs = check.fresh(n)
        ok = cc.save(slot_mapping=list(range(BLOCK * n)), hashes=hs,
                     offsets=[BLOCK] * n).success == n
        for layer in kv:
            for x in layer:
                x.zero_()
        ok &= cc.load(slot_mapping=list(range(BLOCK * 48, BLOCK * (48 + n))), hashes=hs,
                      offsets=[BLOCK] * n).success == n
        torch.cuda.synchronize()
        ok &= all(torch.equal(bits(x[48:48 + n]), bits(r[:n]))
                  and not bits(x[:48]).any() for layer, rl in zip(kv, ref)
                  for x, r in zip(layer, rl))
        out[f"v1_slot_mapping_{name}"] = bool(ok)
        # chunk_descs (what the vLLM connector sends): blocks 72.. from blocks 48..
        hs2 = check.fresh(n)
        descs = [[(BLOCK * (48 + i), BLOCK) for i in range(n)]]
        ok = cc.save(hashes=hs2, chunk_descs=descs).success == n
        ok &= cc.load(hashes=hs2, chunk_descs=[[(BLOCK * (72 + i), BLOCK)
                                                 for i in range(n)]]).success == n
        torch.cuda.synchronize()
        ok &= all(torch.equal(bits(x[72:72 + n]), bits(r[:n]))
                  for layer, rl in zip(kv, ref) for x, r in zip(layer, rl))
        out[f"v1_chunk_descs_{name}"] = bool(ok)
        del kv, ref
    src = torch.randint(0, 256, (32, 2, 1 << 20), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    keys = [f"gpu-check-v0-{check.fresh(1)[0]}-{i}" for i in range(32)]

    def regions(t: Any) -> list[list[Any]]:
        return [[KvBufferWrapper(t[i, j].data_ptr(), t[i, j].numel()) for j in (0, 1)]
                for i in range(32)]

    torch.cuda.synchronize()
    ok = cc.save(CcKvOption(), keys, regions(src)).success == 32
    ok &= cc.load(CcKvOption(), keys, regions(dst)).success == 32
    out["v0_device_buffers"] = bool(ok and torch.equal(src, dst))
    return out


def torch_copies(check: Check, run: int) -> dict[str, float]:
    """GB/s of torch copies of ``check.total`` bytes in runs of ``run``: to pinned and
    to pageable host memory (each way), and one bulk pinned copy each way."""
    torch, total = check.torch, check.total
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(total, dtype=torch.uint8)
    pageable.fill_(1)  # (fault its pages in before timing)
    stream = torch.cuda.Stream()
    n = total // run

    def per_run(host: Any, save: bool) -> Callable[[], None]:
        def go() -> None:
            with torch.cuda.stream(stream):
                for i in range(n):
                    a, b = host[i * run:(i + 1) * run], dev[i * run:(i + 1) * run]
                    if save:
                        a.copy_(b, non_blocking=True)
                    else:
                        b.copy_(a, non_blocking=True)
            stream.synchronize()
        return go

    def bulk(save: bool) -> Callable[[], None]:
        def go() -> None:
            with torch.cuda.stream(stream):
                if save:
                    pinned.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(pinned, non_blocking=True)
            stream.synchronize()
        return go

    out = {}
    for op, save in (("save", True), ("load", False)):
        out[f"{op}_pinned"] = total / check.timed(per_run(pinned, save)) / 1e9
        out[f"{op}_pageable"] = total / check.timed(per_run(pageable, save)) / 1e9
        out[f"{op}_pinned_bulk"] = total / check.timed(bulk(save)) / 1e9
    return out


def ems_v1(check: Check, run: int) -> dict[str, float]:
    """GB/s of V1 saves and loads whose pool objects are ``run`` bytes."""
    torch, cc = check.torch, check.cc
    layers = run // (2 * TENSOR_BLOCK)
    n = check.total // run
    kv = check.caches(layers, n, torch.float16)
    cc.register_kvcache(kv)
    slots, offs = list(range(BLOCK * n)), [BLOCK] * n
    hashes: list[list[int]] = []

    def save() -> None:
        hs = check.fresh(n)
        hashes.append(hs)
        assert cc.save(slot_mapping=slots, hashes=hs, offsets=offs).success == n

    def load() -> None:
        assert cc.load(slot_mapping=slots, hashes=hashes[-1], offsets=offs).success == n

    out = {"save": check.total / check.timed(save) / 1e9,
           "load": check.total / check.timed(load) / 1e9}
    del kv
    return out


def ems_v0(check: Check, run: int) -> dict[str, float]:
    torch, cc = check.torch, check.cc
    from ems import CcKvOption, KvBufferWrapper
    n = check.total // run
    dev = torch.randint(0, 256, (n, run), dtype=torch.uint8, device="cuda")
    regions = [[KvBufferWrapper(dev[i].data_ptr(), run)] for i in range(n)]
    names: list[list[str]] = []

    def save() -> None:
        base = check.fresh(1)[0]
        keys = [f"gpu-check-{base}-{i}" for i in range(n)]
        names.append(keys)
        assert cc.save(CcKvOption(timeout=60000), keys, regions).success == n

    def load() -> None:
        assert cc.load(CcKvOption(timeout=60000), names[-1], regions).success == n

    out = {"save": check.total / check.timed(save) / 1e9,
           "load": check.total / check.timed(load) / 1e9}
    del dev
    return out


def stall(check: Check, seconds: float) -> dict[str, float]:
    """Matmul iteration time on the engine's stream alone and with saves in flight."""
    torch, cc = check.torch, check.cc
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    n_blocks = 64
    kv = check.caches(LAYERS, n_blocks, torch.float16)  # 2 MiB objects
    cc.register_kvcache(kv)

    def loop(iters: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            torch.mm(a, a)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    loop(20)  # warm up
    iters = max(20, int(seconds * 1000 / max(loop(20), 1e-3)))
    alone = statistics.median(loop(iters) for _ in range(3))
    stop = threading.Event()
    saved = [0]

    def saver() -> None:
        slots, offs = list(range(BLOCK * n_blocks)), [BLOCK] * n_blocks
        while not stop.is_set():
            saved[0] += cc.save(slot_mapping=slots, hashes=check.fresh(n_blocks),
                                offsets=offs).success

    thread = threading.Thread(target=saver, daemon=True)
    thread.start()
    time.sleep(0.2)
    try:
        busy = statistics.median(loop(iters) for _ in range(3))
    finally:
        stop.set()
        thread.join(60)
    del kv
    return {"alone_ms": alone, "with_saves_ms": busy, "ratio": busy / alone,
            "iterations": iters, "blocks_saved": saved[0]}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here (e.g. docs/bench-gpu.json)")
    ap.add_argument("--total-mib", type=int, default=256,
                    help="bytes per timed save/load (default 256 MiB)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (best is kept)")
    ap.add_argument("--stall-s", type=float, default=2.0,
                    help="seconds of matmul per timed loop (default 2)")
    ap.add_argument("--capacity", default="8G", help="the ems-server's pool (default 8G)")
    args = ap.parse_args(argv)
    reason = no_cuda_reason()
    if reason is not None:
        print(f"gpu_check: no CUDA device ({reason}); nothing to check")
        return 0
    import torch

    from ems import CcConfig, CcConfig_v1, Ems, EmsConfig, __version__
    from ems.testing import run_server
    t_start = time.perf_counter()
    with run_server(capacity=args.capacity) as server:
        os.environ.update(server.client_env())
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="gpu-check"),
                           cc_config_v1=CcConfig_v1(rank_id=0, device_id=0,
                                                    model_id="gpu-check")))
        try:
            check = Check(torch, args.total_mib << 20, args.reps)
            ok = exact(check)  # (its first device copy starts the registration)
            registration = wait_registered()
            rows = []
            for run in RUNS:
                ref = torch_copies(check, run)
                for api, measure in (("v1", ems_v1), ("v0", ems_v0)):
                    got = measure(check, run)
                    for op in ("save", "load"):
                        rows.append({
                            "api": api, "run_bytes": run, "op": op, "gbps": got[op],
                            "pinned_gbps": ref[f"{op}_pinned"],
                            "pageable_gbps": ref[f"{op}_pageable"],
                            "pinned_bulk_gbps": ref[f"{op}_pinned_bulk"],
                            "x_pinned": got[op] / ref[f"{op}_pinned"],
                            "x_pageable": got[op] / ref[f"{op}_pageable"]})
            stalls = stall(check, args.stall_s)
        finally:
            Ems.finalize()
    result = {
        "schema": 1,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "device": torch.cuda.get_device_name(0),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "ems": __version__,
                    "platform": platform.platform()},
        "args": {"total_mib": args.total_mib, "reps": args.reps, "stall_s": args.stall_s,
                 "capacity": args.capacity},
        "registration": registration,
        "exact": ok,
        "throughput": rows,
        "stall": stalls,
    }
    print(gpu_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
