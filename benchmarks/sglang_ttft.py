#!/usr/bin/env python3
"""Time to first token of a real SGLang (CPU torch) with ems as its HiCache L3, without
L3, and with SGLang's own ``file`` L3 backend, alternating in the same run under the
same load.

    python benchmarks/sglang_ttft.py [--rounds 3] [--prompts 2] [--busy-cores 0 1]
                                     [--prompt-tokens 1024] [--out FILE]

The engines run in the SGLang venv (``scripts/sglang-venv.sh``) through the test
harness's engine script (``tests/sglang/engine_run.py``, with its CPU shims), one after
the other, on a random-weight Llama big enough that prefill dominates (8 layers, hidden
1024, 16 heads / 4 KV heads); a real ``ems-server`` holds the pool. Each regime
(``--busy-cores N``: N busy-loop processes, bounded and stopped by PID, keep N cores
busy; 0 is the machine as it is, its load average recorded) runs ``--rounds`` rounds;
each round starts one engine of each kind, in an order that rotates from round to
round, with new prompts (a new prefix of ``--prompt-tokens`` tokens plus a short tail):

* ``off``  -- HiCache without L3: every prompt cold (the baseline);
* ``ems`` / ``file`` -- ems's ``EmsStorage`` / SGLang's ``file`` backend (a directory in
  the machine's temp dir: the page cache serves it) as L3: the prompts cold (``miss``:
  the lookups miss and the pages are backed up; the engine waits until the L3 holds
  them all), then ``flush_cache`` (the device and host caches emptied, L3 kept, SGLang's
  storage threads restarted) and the same prefixes with another tail (``hit``: the
  prefix comes from L3 only, as in a fresh engine).

Every engine first serves one unmeasured prompt of the same length (its first forward
pays one-off costs). Each ems engine has a tenant of its own and each ``file`` engine a
directory of its own, so "the L3 holds them all" is an exact count.

Then, in the same venv against the same daemon, the backend alone (no engine):
``batch_exists`` of 128 pages that are not stored (the cost of a miss on SGLang's
prefetch thread) and ``batch_set_v1`` / ``batch_get_v1`` of 128 pages of the
benchmark model's page size (8 layers x 16 tokens x 4 KV heads x 64 x K,V in bf16 =
128 KiB).

TTFT is the wall time of a 1-token request (``engine.generate``, arrival to the first
token, the L3 prefetch included: SGLang waits for it with ``wait_complete``). The JSON
records, per regime, the load average before and after and at every step, the
OpenMP environment (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``, ``OMP_NUM_THREADS``) and
each engine's OpenMP workers (``ems.testing.openmp``), and the targets: ems's hit
median <= ``file``'s, ems's miss median <= 1.1x ``file``'s and <= 1.1x no L3, every
hit's whole prefix from L3, identical outputs. Prints a table, writes JSON (default
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
KINDS = ("off", "ems", "file")
#: a busy-loop process's own bound: it ends by itself if we die without stopping it
BUSY_LIMIT_S = 3600
OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


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


class BusyCores:
    """``n`` busy-loop processes (each bounded by ``BUSY_LIMIT_S``), stopped by PID."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "BusyCores":
        loop = (f"import time\nend = time.monotonic() + {BUSY_LIMIT_S}\n"
                "while time.monotonic() < end:\n    pass\n")
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", loop],
                                               stdin=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def summary(ttft: list[float]) -> dict:
    return {"ttft_s": ttft, "ttft_median_s": statistics.median(ttft),
            "ttft_min_s": min(ttft)}


def run_regime(py: str, env: dict, tmp: str, model: str, busy: int,
               args: argparse.Namespace, rng: random.Random) -> dict:
    """One regime: ``--rounds`` rounds of the three engines, alternating."""
    from ems.testing import run_server

    tok = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    n_tokens = args.prompt_tokens + args.tail_tokens
    tenants = {f"bench-{r}": f"{r:032d}" for r in range(args.rounds)}
    regime_dir = tempfile.mkdtemp(prefix=f"busy{busy}-", dir=tmp)
    os.makedirs(os.path.join(regime_dir, "pool"))
    specs, prompts = [], []
    with run_server(os.path.join(regime_dir, "pool"), capacity="2G",
                    tenants=tenants) as server, BusyCores(busy):
        renv = dict(env, **server.client_env())
        common = {"model": model, "max_new_tokens": 1, "max_total_tokens": 8192,
                  "layout": "page_first_direct"}
        for r in range(args.rounds):
            prefixes = [tok(args.prompt_tokens) for _ in range(args.prompts)]
            cold = [p + tok(args.tail_tokens) for p in prefixes]
            warm = [p + tok(args.tail_tokens) for p in prefixes]
            prompts.append({"cold": cold, "warm": warm})
            pages = (1 + args.prompts) * (n_tokens // PAGE)  # the warm-up's and cold's
            order = KINDS[r % 3:] + KINDS[:r % 3]  # rotates: each kind goes first once
            for kind in order:
                steps = [{"name": "warmup", "prompts": [tok(n_tokens)]}]
                spec = dict(common, name=f"{kind}#{r}", steps=steps)
                if kind == "off":
                    spec.update(storage=None, hicache=True)
                    steps.append({"name": "cold", "prompts": cold})
                    specs.append(spec)
                    continue
                cold_step = {"name": "cold", "prompts": cold}
                if kind == "ems":
                    tenant = f"bench-{r}"
                    spec.update(storage="ems", extra={"access_id": tenant,
                                                      "access_key": tenants[tenant]})
                    cold_step["wait_pool"] = {"socket": server.socket_path, "objects": pages,
                                              "tenant": tenant, "timeout_s": 300}
                else:
                    files = os.path.join(regime_dir, f"file-l3-{r}")
                    os.makedirs(files)
                    spec.update(storage="file", extra={"file_storage_path": files})
                    cold_step["wait_files"] = {"dir": files, "count": pages,
                                               "timeout_s": 300}
                steps += [cold_step, {"name": "warm", "prompts": warm, "flush": True}]
                specs.append(spec)
        spec_path = os.path.join(regime_dir, "spec.json")
        out_path = os.path.join(regime_dir, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"engines": specs}, f)
        load_before = os.getloadavg()
        t0 = time.monotonic()
        r = subprocess.run([py, os.path.join(HARNESS, "engine_run.py"), spec_path,
                            out_path], env=renv, capture_output=True, text=True)
        elapsed = time.monotonic() - t0
        load_after = os.getloadavg()
        if r.returncode != 0:
            sys.exit(f"engines failed ({r.returncode}):\n{r.stdout[-2000:]}"
                     f"{r.stderr[-4000:]}")
        with open(out_path) as f:
            engines = json.load(f)["engines"]
        probe = None
        if busy == args.busy_cores[0]:  # the backend alone, once
            p = subprocess.run([py, os.path.abspath(__file__), "--probe",
                                server.socket_dir, "--probe-reps", str(args.probe_reps)],
                               env=dict(renv, EMS_ACCESS_ID="bench-0",
                                        EMS_ACCESS_KEY=tenants["bench-0"]),
                               capture_output=True, text=True)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                sys.exit(f"the backend probe failed:\n{p.stderr[-3000:]}")
            probe = json.loads(lines[-1][len("RESULT "):])
    return digest(engines, busy, load_before, load_after, elapsed, args, probe)


def digest(engines: list[dict], busy: int, load_before: tuple, load_after: tuple,
           elapsed: float, args: argparse.Namespace, probe: "dict | None") -> dict:
    """The regime's rows: every sample of each kind pooled over the rounds."""
    samples: dict[str, dict[str, list]] = {}
    for e in engines:
        kind = e["name"].split("#")[0]
        for st in e["steps"]:
            if st["name"] == "warmup":
                continue
            row = kind if kind == "off" else f"{kind}-{'miss' if st['name'] == 'cold' else 'hit'}"
            acc = samples.setdefault(row, {"s": [], "storage": [], "tokens": [],
                                           "openmp": [], "loadavg_1m": [], "start_s": []})
            acc["s"] += st["s"]
            acc["storage"] += [d.get("storage", 0) for d in st["details"]]
            acc["tokens"] += st["tokens"]
            acc["openmp"].append(st["openmp"])
            acc["loadavg_1m"].append(st["loadavg_1m"])
            acc["start_s"].append(e["start_s"])
    rows = {name: dict(summary(a["s"]), storage_hit_tokens=a["storage"], tokens=a["tokens"],
                       openmp=a["openmp"], loadavg_1m=a["loadavg_1m"], start_s=a["start_s"])
            for name, a in samples.items()}
    med = {name: row["ttft_median_s"] for name, row in rows.items()}
    prefix = args.prompt_tokens // PAGE * PAGE
    hits = rows["ems-hit"]["storage_hit_tokens"] + rows["file-hit"]["storage_hit_tokens"]
    ratios = {"ems_hit_vs_file_hit": med["ems-hit"] / med["file-hit"],
              "ems_miss_vs_file_miss": med["ems-miss"] / med["file-miss"],
              "ems_miss_vs_off": med["ems-miss"] / med["off"]}
    checks = {
        "every_hit_whole_prefix": all(h >= prefix for h in hits),
        "outputs_identical": (rows["off"]["tokens"] == rows["ems-miss"]["tokens"]
                              == rows["file-miss"]["tokens"]
                              and rows["ems-hit"]["tokens"] == rows["file-hit"]["tokens"]),
    }
    targets = {"ems_hit_le_file_hit": ratios["ems_hit_vs_file_hit"] <= 1.0,
               "ems_miss_le_1.1x_file_miss": ratios["ems_miss_vs_file_miss"] <= 1.1,
               "ems_miss_le_1.1x_off": ratios["ems_miss_vs_off"] <= 1.1, **checks}
    out = {"busy_cores": busy, "loadavg_before": list(load_before),
           "loadavg_after": list(load_after), "elapsed_s": round(elapsed, 1),
           "engines": rows, "ratios": ratios, "targets": targets,
           "speedup_hit_vs_off": {k: med["off"] / med[f"{k}-hit"] for k in ("ems", "file")}}
    if probe is not None:
        out["backend_probe"] = probe
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds per regime: one engine of each kind each")
    ap.add_argument("--prompts", type=int, default=2, help="measured prompts per step")
    ap.add_argument("--busy-cores", type=int, nargs="+", default=[0, 1],
                    help="the regimes: how many cores busy-loop processes keep busy")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tail-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(REPO, "bench-results", "sglang_ttft.json"))
    ap.add_argument("--probe", metavar="SOCKET_DIR", help=argparse.SUPPRESS)  # venv side
    ap.add_argument("--probe-reps", type=int, default=20)
    args = ap.parse_args()
    if args.probe:
        probe_main(args.probe, args.probe_reps)
        return
    py = venv_python()
    tmp = tempfile.mkdtemp(prefix="ems-sglang-ttft-")
    try:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("EMS_", "SGLANG_", "PYTHON"))}
        env.update(PYTHONPATH=os.path.join(HARNESS, "shim"), SGLANG_USE_CPU_ENGINE="1",
                   TMPDIR=tmp, XDG_CACHE_HOME=os.path.join(tmp, "cache"),
                   SGLANG_CACHE_DIR=os.path.join(tmp, "cache", "sglang"),
                   TORCH_EXTENSIONS_DIR=os.path.join(tmp, "cache", "torch"))
        model = os.path.join(tmp, "llama")
        subprocess.run([py, os.path.join(REPO, "tests", "vllm", "make_model.py"), model,
                        "--layers", str(args.layers), "--hidden", str(args.hidden),
                        "--heads", "16", "--kv-heads", "4", "--vocab", "1024"],
                       env=env, check=True, capture_output=True)
        rng = random.Random(7)
        regimes = [run_regime(py, env, tmp, model, busy, args, rng)
                   for busy in args.busy_cores]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": 16, "kv_heads": 4,
                  "dtype": "bfloat16", "page_size": PAGE},
        "prompt_tokens": args.prompt_tokens + args.tail_tokens,
        "prefix_tokens": args.prompt_tokens, "rounds": args.rounds, "prompts": args.prompts,
        "cpus": len(os.sched_getaffinity(0)),
        "openmp_env": {k: os.environ.get(k, "unset") for k in OPENMP_ENV},
        "regimes": regimes,
        "backend_probe": next(r.pop("backend_probe") for r in regimes
                              if "backend_probe" in r),
    }
    print(f"SGLang TTFT, {args.prompt_tokens}+{args.tail_tokens} tokens, {args.rounds} "
          f"rounds x {args.prompts} prompts, {args.layers} layers x {args.hidden}, "
          f"OpenMP {result['openmp_env']}")
    for reg in regimes:
        print(f"-- {reg['busy_cores']} core(s) kept busy; load average "
              f"{reg['loadavg_before'][0]:.2f} -> {reg['loadavg_after'][0]:.2f}")
        print(f"{'engine':<10} {'median s':>9} {'min s':>8} {'L3 hit tokens':>14} "
              f"{'OpenMP workers':>15}")
        for name, row in reg["engines"].items():
            workers = sorted({o["workers"] for o in row["openmp"]})
            print(f"{name:<10} {row['ttft_median_s']:>9.3f} {row['ttft_min_s']:>8.3f} "
                  f"{statistics.median(row['storage_hit_tokens']):>14.0f} "
                  f"{str(workers):>15}")
        print("ratios " + ", ".join(f"{k} {v:.2f}" for k, v in reg["ratios"].items()))
        print("targets " + ", ".join(f"{k} {'ok' if v else 'MISSED'}"
                                     for k, v in reg["targets"].items()))
    probe = result["backend_probe"]
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
