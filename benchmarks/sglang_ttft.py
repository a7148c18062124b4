#!/usr/bin/env python3
"""Time to first token of a real SGLang (CPU torch) with ems as its HiCache L3, without
L3, and with SGLang's own ``file`` L3 backend, on the same machine in the same run.

    python benchmarks/sglang_ttft.py [--rounds 3] [--prompt-tokens 1024] [--out FILE]

The engines run in the SGLang venv (``scripts/sglang-venv.sh``) through the test
harness's engine script (``tests/sglang/engine_run.py``, with its CPU shims), one after
the other in one process, on a random-weight Llama big enough that prefill dominates
(8 layers, hidden 1024, 16 heads / 4 KV heads); a real ``ems-server`` holds the pool.
Each round's prompt is a new prefix of ``--prompt-tokens`` tokens plus a short tail:

* ``off``       -- HiCache without L3, every prompt cold (the baseline);
* ``ems-miss``  -- ems as L3, the same prompts cold: the lookups miss and the pages are
  backed up (the cost of a miss: ``ems-miss`` vs ``off``);
* ``file-miss`` -- the same with SGLang's ``file`` backend (a directory in the
  machine's temp dir: the page cache serves it);
* ``ems-hit`` / ``file-hit`` -- fresh engines (nothing in their GPU/host cache) on the
  same prefixes with another tail: the prefix comes from L3; ``--hit-engines`` of each,
  ems and file alternating, their samples pooled.

Then, in the same venv against the same daemon, the backend alone (no engine):
``batch_exists`` of 128 pages that are not stored (the cost of a miss on SGLang's
prefetch thread) and ``batch_set_v1`` / ``batch_get_v1`` of 128 pages of the
benchmark model's page size (8 layers x 16 tokens x 4 KV heads x 64 x K,V in bf16 =
128 KiB).

TTFT is the wall time of a 1-token request (``engine.generate``, arrival to the first
token, the L3 prefetch included: SGLang waits for it with ``wait_complete``). Before a
hit engine starts, the previous engine's backups are waited for (pool objects / page
files). Engines run sequentially, so a drift of the shared machine between them is not
cancelled out: compare medians, and rerun. Prints a table, writes JSON (default
``bench-results/sglang_ttft.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(REPO, "tests", "sglang")
PAGE = 16


# ---------------------------------------------------------------- backend probe (venv)
def probe_main(socket_dir: str, reps: int) -> None:
    """Time EmsStorage's calls on 128 pages; print ``RESULT <json>``."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from ems.integrations.sglang import EmsStorage

    class HostPool:  # SGLang's page_first_direct MHA layout: [2, pages, layers, 16, H, D]
        layout, page_size, dtype = "page_first_direct", PAGE, torch.bfloat16

        def __init__(self, pages: int) -> None:
            self.kv = torch.randn(2, pages, 8, PAGE, 4, 64).to(torch.bfloat16)

        def get_page_buffer_meta(self, indices):
            ptrs = []
            for i in range(0, len(indices), PAGE):
                p = int(indices[i]) // PAGE
                ptrs += [self.kv[0, p].data_ptr(), self.kv[1, p].data_ptr()]
            return ptrs, [self.kv[0, 0].numel() * 2] * len(ptrs)

    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="probe", extra_config={"pool": "server", "socket_dir": socket_dir})
    storage = EmsStorage(cfg, {})
    storage.register_mem_pool_host(HostPool(256))
    n = 128
    slots = torch.arange(n * PAGE)

    def timed(fn) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    rnd = random.Random(1)
    miss = timed(lambda: storage.batch_exists([f"{rnd.getrandbits(256):064x}"
                                               for _ in range(n)]))
    sets, gets = [], []
    for _ in range(reps):
        keys = [f"{rnd.getrandbits(256):064x}" for _ in range(n)]
        t0 = time.perf_counter()
        assert all(storage.batch_set_v1(keys, slots))
        sets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert all(storage.batch_get_v1(keys, slots + n * PAGE))
        gets.append(time.perf_counter() - t0)
    page_bytes = 2 * 8 * PAGE * 4 * 64 * 2
    storage.close()
    print("RESULT " + json.dumps({
        "pages": n, "page_bytes": page_bytes,
        "exists_miss_ms_median": statistics.median(miss) * 1e3,
        "set_ms_median": statistics.median(sets) * 1e3,
        "get_ms_median": statistics.median(gets) * 1e3,
        "set_gbps": n * page_bytes / statistics.median(sets) / 1e9,
        "get_gbps": n * page_bytes / statistics.median(gets) / 1e9}))


def venv_python() -> str:
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "sglang-venv.sh")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stdout.strip() or r.stderr[-2000:])
    return r.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tail-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--hit-engines", type=int, default=2,
                    help="fresh hit engines per backend, ems and file alternating")
    ap.add_argument("--out", default=os.path.join(REPO, "bench-results", "sglang_ttft.json"))
    ap.add_argument("--probe", metavar="SOCKET_DIR", help=argparse.SUPPRESS)  # venv side
    ap.add_argument("--probe-reps", type=int, default=20)
    args = ap.parse_args()
    if args.probe:
        probe_main(args.probe, args.probe_reps)
        return
    from ems.testing import run_server

    py = venv_python()
    tmp = tempfile.mkdtemp(prefix="ems-sglang-ttft-")
    try:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("EMS_", "SGLANG_", "PYTHON"))}
        env.update(PYTHONPATH=os.path.join(HARNESS, "shim"), SGLANG_USE_CPU_ENGINE="1",
                   TMPDIR=tmp, XDG_CACHE_HOME=os.path.join(tmp, "cache"),
                   SGLANG_CACHE_DIR=os.path.join(tmp, "cache", "sglang"),
                   TORCH_EXTENSIONS_DIR=os.path.join(tmp, "cache", "torch"),
                   SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=os.path.join(tmp, "file-l3"))
        model = os.path.join(tmp, "llama")
        subprocess.run([py, os.path.join(REPO, "tests", "vllm", "make_model.py"), model,
                        "--layers", str(args.layers), "--hidden", str(args.hidden),
                        "--heads", "16", "--kv-heads", "4", "--vocab", "1024"],
                       env=env, check=True, capture_output=True)
        rng = random.Random(7)
        tok = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
        prefixes = [tok(args.prompt_tokens) for _ in range(args.rounds)]
        cold = [p + tok(args.tail_tokens) for p in prefixes]
        warm = [p + tok(args.tail_tokens) for p in prefixes]
        pages = args.rounds * (args.prompt_tokens // PAGE)
        os.makedirs(os.path.join(tmp, "pool"))
        os.makedirs(os.path.join(tmp, "file-l3"))
        with run_server(os.path.join(tmp, "pool"), capacity="2G") as server:
            env.update(server.client_env())
            common = {"model": model, "max_new_tokens": 1, "max_total_tokens": 8192,
                      "layout": "page_first_direct"}

            def step(name: str, prompts: list, **kw: object) -> dict:
                return {"name": name, "prompts": prompts, **kw}

            specs = [
                dict(common, name="off", storage=None, hicache=True,
                     steps=[step("cold", cold)]),
                dict(common, name="ems-miss", storage="ems",
                     steps=[step("cold", cold, wait_pool={
                         "socket": server.socket_path, "objects": pages})]),
                dict(common, name="file-miss", storage="file",
                     steps=[step("cold", cold, wait_files={
                         "dir": os.path.join(tmp, "file-l3"), "count": pages})]),
            ]
            for i in range(args.hit_engines):  # alternating: a drift hits both alike
                for backend in ("ems", "file"):
                    specs.append(dict(common, name=f"{backend}-hit#{i}", storage=backend,
                                      steps=[step("warm", warm)]))
            spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
            with open(spec_path, "w") as f:
                json.dump({"engines": specs}, f)
            t0 = time.monotonic()
            r = subprocess.run([py, os.path.join(HARNESS, "engine_run.py"), spec_path,
                                out_path], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"engines failed ({r.returncode}):\n{r.stdout[-2000:]}"
                         f"{r.stderr[-4000:]}")
            with open(out_path) as f:
                engines = {e["name"]: e for e in json.load(f)["engines"]}
            elapsed = time.monotonic() - t0
            r = subprocess.run([py, os.path.abspath(__file__), "--probe", server.socket_dir,
                                "--probe-reps", str(args.probe_reps)], env=env,
                               capture_output=True, text=True)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            if r.returncode != 0 or not lines:
                sys.exit(f"the backend probe failed:\n{r.stderr[-3000:]}")
            probe = json.loads(lines[-1][len("RESULT "):])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    for backend in ("ems", "file"):  # the hit engines' samples together
        runs = [engines.pop(f"{backend}-hit#{i}") for i in range(args.hit_engines)]
        engines[f"{backend}-hit"] = {
            "start_s": [r["start_s"] for r in runs],
            "steps": [{k: [x for r in runs for x in r["steps"][0][k]]
                       for k in ("s", "details", "tokens")}]}
    rows = {}
    for name, e in engines.items():
        st = e["steps"][0]
        storage = [d.get("storage", 0) for d in st["details"]]
        rows[name] = {"ttft_s": st["s"], "ttft_median_s": statistics.median(st["s"]),
                      "ttft_min_s": min(st["s"]), "storage_hit_tokens": storage,
                      "start_s": e["start_s"], "tokens": st["tokens"]}
    off = rows["off"]["ttft_median_s"]
    result = {
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": 16, "kv_heads": 4,
                  "dtype": "bfloat16", "page_size": PAGE},
        "prompt_tokens": args.prompt_tokens + args.tail_tokens,
        "prefix_tokens": args.prompt_tokens, "rounds": args.rounds,
        "hit_engines": args.hit_engines,
        "engines": rows,
        "miss_overhead_median_s": {k: rows[f"{k}-miss"]["ttft_median_s"] - off
                                   for k in ("ems", "file")},
        "speedup_hit_vs_off": {k: off / rows[f"{k}-hit"]["ttft_median_s"]
                               for k in ("ems", "file")},
        "hit_outputs_equal": rows["ems-hit"]["tokens"] == rows["file-hit"]["tokens"],
        "backend_probe": probe,
        "elapsed_s": round(elapsed, 1),
    }
    print(f"SGLang TTFT, {args.prompt_tokens}+{args.tail_tokens} tokens, "
          f"{args.rounds} prompts, {args.layers} layers x {args.hidden}")
    print(f"{'engine':<10} {'median s':>9} {'min s':>8} {'storage hit tokens':>20}")
    for name, row in rows.items():
        print(f"{name:<10} {row['ttft_median_s']:>9.3f} {row['ttft_min_s']:>8.3f} "
              f"{statistics.median(row['storage_hit_tokens']):>20.0f}")
    print(f"miss overhead vs off (median): ems {result['miss_overhead_median_s']['ems']:+.3f} s,"
          f" file {result['miss_overhead_median_s']['file']:+.3f} s")
    print(f"hit speed-up vs off: ems {result['speedup_hit_vs_off']['ems']:.1f}x, "
          f"file {result['speedup_hit_vs_off']['file']:.1f}x")
    print(f"backend alone, {probe['pages']} pages of {probe['page_bytes'] >> 10} KiB: "
          f"batch_exists (miss) {probe['exists_miss_ms_median']:.2f} ms, batch_set_v1 "
          f"{probe['set_ms_median']:.1f} ms ({probe['set_gbps']:.2f} GB/s), batch_get_v1 "
          f"{probe['get_ms_median']:.1f} ms ({probe['get_gbps']:.2f} GB/s)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
