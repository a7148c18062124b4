"""``ems demo``: prefix caching in a real decoding loop, checked exact and timed.

The demo builds a small Llama-style model with random weights (no model download
exists on this machine: the weights come from ``--seed``), a workload of prompts
sharing a few long prefixes, and runs it twice through the same paged-KV engine:

1. **without ems**: every request prefills its whole prompt;
2. **with ems**: each request first loads the leading KV blocks the pool holds
   (saved by earlier requests of the same prefix), prefills only the rest, and
   saves the blocks it computed.

It prints per-request and total prefill time, tokens computed versus loaded, the
hit rate and the bytes moved, and checks that both runs chose the same greedy
tokens with logits within ``--atol``. It exits 1 when they differ.

``--instances N`` runs the ems pass in N worker processes one after another,
sharing the ``ems-server`` daemon's pool: the second instance finds what the
first saved. It needs the daemon (``EMS_POOL=server``, or ``auto`` with the
daemon's socket present) and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Optional, TextIO

import torch

import ems
from ems import CcConfig_v1, Ems, EmsConfig, EmsException
from ems.config import PoolSettings
from ems.demo.connector import EmsConnector
from ems.demo.engine import Engine, RequestStats, Workload, make_workload
from ems.demo.model import LlamaModel, ModelConfig
from ems.demo.scheduler import Request, block_hashes

__all__ = ["Comparison", "compare", "main"]

#: Options a ``--instances`` worker is started with (dest names of the parser).
_FORWARDED = ("prefixes", "requests", "prefix_tokens", "suffix_tokens", "decode_tokens",
              "layers", "hidden", "heads", "kv_heads", "vocab", "block_size", "seed",
              "threads", "timeout_ms")


# ------------------------------------------------------------------- settings

@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Everything one run needs, derived once from the command line."""

    model: ModelConfig
    workload: Workload
    block_size: int
    timeout_ms: int
    atol: float

    @property
    def model_id(self) -> str:
        """Names the weights: blocks of another model or seed must never be loaded."""
        m = self.model
        return (f"demo-llama.v{m.vocab_size}.l{m.num_layers}.h{m.hidden_size}"
                f".q{m.num_heads}.kv{m.num_kv_heads}.seed{m.seed}")

    @property
    def num_blocks(self) -> int:
        """Device blocks: room for two requests, so the FIFO free list rotates."""
        w = self.workload
        return 2 * (-(-(w.prompt_tokens + w.decode_tokens) // self.block_size))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ems demo",
        description="Prefix caching in a real decoding loop: a small Llama-style model "
                    "(random weights from --seed; no model download exists here) runs a "
                    "shared-prefix workload without and with ems, checks the outputs are "
                    "identical and reports the prefill time saved.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--prefixes", type=int, default=3, help="distinct shared prefixes")
    w.add_argument("--requests", type=int, default=8, help="requests per prefix")
    w.add_argument("--prefix-tokens", type=int, default=1536, help="tokens of each prefix")
    w.add_argument("--suffix-tokens", type=int, default=128,
                   help="unique tokens after the prefix, per request")
    w.add_argument("--decode-tokens", type=int, default=8,
                   help="tokens generated greedily per request")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=4, help="decoder layers")
    m.add_argument("--hidden", type=int, default=256, help="hidden size")
    m.add_argument("--heads", type=int, default=0,
                   help="query heads (0: hidden/32 below 512, hidden/64 from there)")
    m.add_argument("--kv-heads", type=int, default=0, help="K/V heads (0: heads/4)")
    m.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    m.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    m.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    r = p.add_argument_group("run")
    r.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="torch CPU threads")
    r.add_argument("--timeout-ms", type=int, default=5000,
                   help="CcKvOption.timeout of each load and save")
    r.add_argument("--atol", type=float, default=1e-4,
                   help="largest allowed |logit difference| between the two runs")
    r.add_argument("--instances", type=int, default=1,
                   help="run the ems pass in N worker processes, one after another, "
                        "sharing the ems-server daemon's pool (needs EMS_POOL=server)")
    r.add_argument("--hosts", type=int, default=1,
                   help="N > 1: N simulated hosts (one ems-server each) on one local "
                        "Valkey Cluster; an instance per host, one after another (needs "
                        "the cluster extra); see ems.demo.hosts")
    r.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    # Hidden: how --instances starts its workers (results file, progress label).
    r.add_argument("--worker-out", help=argparse.SUPPRESS)
    r.add_argument("--worker-label", default="worker", help=argparse.SUPPRESS)
    return p


def _settings(args: argparse.Namespace) -> DemoSettings:
    """Check the numbers and build the configs; ``ValueError`` says what is wrong."""
    for name in ("prefixes", "requests", "prefix_tokens", "suffix_tokens", "decode_tokens",
                 "block_size", "threads", "instances", "hosts"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.timeout_ms < 0 or args.atol < 0:
        raise ValueError("--timeout-ms and --atol must be >= 0")
    model = ModelConfig.for_hidden(args.hidden, num_layers=args.layers, vocab_size=args.vocab,
                                   num_heads=args.heads, num_kv_heads=args.kv_heads,
                                   seed=args.seed)
    workload = Workload(args.prefixes, args.requests, args.prefix_tokens, args.suffix_tokens,
                        args.decode_tokens, args.seed)
    return DemoSettings(model, workload, args.block_size, args.timeout_ms, args.atol)


# ------------------------------------------------------------------- progress

class _Progress:
    """A one-line progress bar on stderr: ``label [#####.....] 12/24``."""

    def __init__(self, label: str, total: int, enabled: bool,
                 stream: TextIO = sys.stderr) -> None:
        self.label, self.total, self.enabled, self.stream = label, total, enabled, stream
        self.done = 0
        self.t0 = time.perf_counter()
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        fill = width * self.done // max(self.total, 1)
        self.stream.write(f"\r{self.label:<14} [{'#' * fill}{'.' * (width - fill)}] "
                          f"{self.done}/{self.total}  {time.perf_counter() - self.t0:5.1f}s")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()

    def step(self, _stats: RequestStats) -> None:
        self.done += 1
        self._draw()


# ------------------------------------------------------------------ comparing

@dataclasses.dataclass
class Comparison:
    """How the ems run's outputs compare with the plain run's."""

    requests: int
    same_tokens: int
    max_logit_diff: float
    atol: float
    mismatched: list[str]

    @property
    def ok(self) -> bool:
        """Same greedy tokens everywhere and every logit within ``atol``."""
        return self.same_tokens == self.requests and self.max_logit_diff <= self.atol


def compare(plain: Sequence[RequestStats], cached: Sequence[RequestStats],
            atol: float) -> Comparison:
    """Compare outputs and logits request by request (NaN counts as infinitely off)."""
    if len(plain) != len(cached):
        raise ValueError(f"{len(plain)} plain results but {len(cached)} cached ones")
    mismatched, worst = [], 0.0
    for a, b in zip(plain, cached):
        if a.output != b.output:
            mismatched.append(a.request_id)
        assert a.logits is not None and b.logits is not None
        steps = min(a.logits.shape[0], b.logits.shape[0])
        diff = (a.logits[:steps] - b.logits[:steps]).abs().max().item()
        worst = max(worst, diff if diff == diff else float("inf"))
    return Comparison(len(plain), len(plain) - len(mismatched), worst, atol, mismatched)


# ------------------------------------------------------------------- the runs

def _engine(settings: DemoSettings) -> Engine:
    """Model and engine, warmed up so the first timed request pays no start-up cost."""
    engine = Engine(LlamaModel(settings.model), settings.num_blocks, settings.block_size)
    warm = make_workload(dataclasses.replace(settings.workload, prefixes=1, requests=1,
                                             seed=settings.workload.seed + 1),
                         settings.model.vocab_size)
    engine.run_all(warm)
    engine.reset()
    return engine


def _init_cc(settings: DemoSettings) -> Any:
    """``Ems.init`` with a V1 config naming this model; the ContextCaching object."""
    cfg = CcConfig_v1(rank_id=0, device_id=0, model_id=settings.model_id,
                      tp_world_size=1, pp_world_size=1, rank_in_tp_group=0,
                      rank_in_pp_group=0, llm_engine="ems-demo")
    Ems.init(EmsConfig(cc_config_v1=cfg))
    cc = Ems.get_cc()
    if cc is None:  # pragma: no cover - init with a cc config always makes one
        raise RuntimeError("Ems.get_cc() returned None after init")
    return cc


@dataclasses.dataclass
class _CachedRun:
    results: list[RequestStats]
    connector: dict[str, Any]
    pool: Optional[dict[str, Any]]


def _run_cached(engine: Engine, settings: DemoSettings, requests: Sequence[Request],
                progress: _Progress) -> _CachedRun:
    """The ems pass: init, register, run every request, collect saves, finalize."""
    cc = _init_cc(settings)
    try:
        connector = EmsConnector(cc, settings.block_size, settings.timeout_ms)
        engine.attach(connector)
        results = engine.run_all(requests, progress.step)
        connector.wait_all()
        pool = None
        if hasattr(cc, "statistics"):
            stats = cc.statistics()
            pool = (dataclasses.asdict(stats)  # type: ignore[arg-type]
                    if dataclasses.is_dataclass(stats) else None)
        return _CachedRun(results, dataclasses.asdict(connector.stats), pool)
    finally:
        engine.attach(None)
        Ems.finalize()


def _run_plain(engine: Engine, requests: Sequence[Request], progress: _Progress
               ) -> list[RequestStats]:
    """The pass without ems: every request prefills its whole prompt."""
    results = engine.run_all(requests, progress.step)
    engine.reset()
    return results


# ------------------------------------------------------------------ reporting

def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _kv_summary(settings: DemoSettings, engine: Engine,
                requests: Sequence[Request]) -> dict[str, Any]:
    """KV sizes of the workload, and the pool it will be written to."""
    distinct = {h for r in requests for h in block_hashes(r.prompt, settings.block_size)}
    block_bytes = engine.block_bytes()
    try:
        pool = PoolSettings.from_env()
        kind = pool.resolved_mode()
        capacity = pool.capacity_bytes if kind == "embedded" else None
    except EmsException as exc:
        kind, capacity = f"invalid settings ({exc.message()})", None
    return {"block_bytes": block_bytes, "distinct_blocks": len(distinct),
            "distinct_bytes": len(distinct) * block_bytes,
            "device_cache_bytes": settings.num_blocks * block_bytes,
            "pool": kind, "pool_capacity_bytes": capacity}


def _print_header(settings: DemoSettings, kv: dict[str, Any], out: TextIO) -> None:
    m, w = settings.model, settings.workload
    print(f"ems {ems.__version__} demo: Llama-style model, {m.num_layers} layers, hidden "
          f"{m.hidden_size}, {m.num_heads} heads / {m.num_kv_heads} KV heads, vocab "
          f"{m.vocab_size}, float32, random weights (seed {m.seed})", file=out)
    print(f"workload: {w.prefixes} prefixes x {w.requests} requests, {w.prefix_tokens} "
          f"shared + {w.suffix_tokens} unique prompt tokens each, {w.decode_tokens} decoded; "
          f"block size {settings.block_size}, torch threads {torch.get_num_threads()}",
          file=out)
    cap = kv["pool_capacity_bytes"]
    print(f"KV: {kv['block_bytes'] // 1024} KiB per block, {kv['distinct_blocks']} distinct "
          f"full blocks = {_mib(kv['distinct_bytes'])}; pool: {kv['pool']}"
          + (f", capacity {_mib(cap)}" if cap else ""), file=out)
    if cap is not None and kv["distinct_bytes"] > cap:
        print(f"warning: the workload's KV ({_mib(kv['distinct_bytes'])}) exceeds the pool "
              f"capacity ({_mib(cap)}): expect evictions and fewer hits (EMS_CAPACITY)",
              file=out)


def _totals(results: Sequence[RequestStats]) -> dict[str, float]:
    return {
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "loaded_tokens": sum(r.loaded_tokens for r in results),
        "computed_tokens": sum(r.computed_tokens for r in results),
        "prefill_s": sum(r.prefill_s for r in results),
        "load_s": sum(r.load_s for r in results),
        "decode_s": sum(r.decode_s for r in results),
        "save_wait_s": sum(r.save_wait_s for r in results),
    }


def _print_requests(plain: Sequence[RequestStats], cached: Sequence[RequestStats],
                    out: TextIO) -> None:
    print(f"\n{'request':<10}{'prompt':>7}{'loaded':>8}{'computed':>9}"
          f"{'plain ms':>10}{'ems ms':>9}{'speedup':>9}  same", file=out)
    for a, b in zip(plain, cached):
        same = "yes" if a.output == b.output else "NO"
        print(f"{a.request_id:<10}{a.prompt_tokens:>7}{b.loaded_tokens:>8}"
              f"{b.computed_tokens:>9}{a.prefill_s * 1e3:>10.1f}{b.prefill_s * 1e3:>9.1f}"
              f"{a.prefill_s / max(b.prefill_s, 1e-9):>8.2f}x  {same}", file=out)


def _print_summary(label: str, plain: dict[str, float], cached: dict[str, float],
                   conn: dict[str, Any], block_bytes: int, cmp: Comparison,
                   out: TextIO) -> None:
    before, after = plain["prefill_s"], cached["prefill_s"]
    print(f"\n{label}prefill total: without ems {before:.2f} s, with ems {after:.2f} s  ->  "
          f"{before / max(after, 1e-9):.2f}x, {before - after:.2f} s saved", file=out)
    hit = cached["loaded_tokens"] / max(cached["prompt_tokens"], 1)
    print(f"{label}prompt tokens {cached['prompt_tokens']}: computed "
          f"{cached['computed_tokens']}, loaded {cached['loaded_tokens']}  (hit rate "
          f"{hit:.1%}; blocks looked up {conn['blocks_looked_up']}, found "
          f"{conn['blocks_found']}, loaded {conn['blocks_loaded']})", file=out)
    loaded_b, saved_b = conn["blocks_loaded"] * block_bytes, conn["blocks_saved"] * block_bytes
    rate = loaded_b / conn["load_s"] / 1e9 if conn["load_s"] > 0 else 0.0
    print(f"{label}bytes moved: loaded {_mib(loaded_b)} in {conn['load_s']:.3f} s "
          f"({rate:.2f} GB/s), saved {_mib(saved_b)} ({conn['blocks_saved']} blocks, "
          f"{conn['blocks_save_failed']} failed; waited {conn['save_wait_s']:.3f} s); "
          f"lookups {conn['lookup_s']:.3f} s; errors {conn['errors']}", file=out)
    verdict = "OK" if cmp.ok else "MISMATCH"
    print(f"{label}outputs: {cmp.same_tokens}/{cmp.requests} requests chose identical greedy "
          f"tokens; max |logit diff| {cmp.max_logit_diff:.2e} (atol {cmp.atol:g})  ->  "
          f"{verdict}", file=out)
    if cmp.mismatched:
        print(f"{label}differing requests: {', '.join(cmp.mismatched)}", file=out)


def _pass_json(results: Sequence[RequestStats]) -> dict[str, Any]:
    return {"totals": _totals(results), "requests": [r.to_json() for r in results]}


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


# ------------------------------------------------------------------ instances

def _worker(settings: DemoSettings, out_path: str, label: str, progress: bool) -> int:
    """A ``--instances`` worker: the ems pass only; results to ``out_path`` (torch.save)."""
    engine = _engine(settings)
    requests = make_workload(settings.workload, settings.model.vocab_size)
    run = _run_cached(engine, settings, requests, _Progress(label, len(requests), progress))
    torch.save({"requests": [r.to_json() for r in run.results],
                "logits": [r.logits for r in run.results],
                "connector": run.connector}, out_path)
    return 0


def _run_instances(settings: DemoSettings, args: argparse.Namespace,
                   progress: bool, out: TextIO) -> int:
    try:
        kind = PoolSettings.from_env().resolved_mode()
    except EmsException as exc:
        print(f"ems demo: {exc.message()}", file=sys.stderr)
        return 2
    if kind != "server":
        print("ems demo: --instances needs the ems-server daemon, so that the instances "
              "share one pool; the pool here would be embedded (one per process). Start "
              "`ems-server` and run with EMS_POOL=server.", file=sys.stderr)
        return 2
    try:  # fail now rather than after the plain pass
        _init_cc(settings)
    except EmsException as exc:
        print(f"ems demo: cannot use the pool ({exc.status_code().name}): {exc.message()}",
              file=sys.stderr)
        return 1
    finally:
        Ems.finalize()
    engine = _engine(settings)
    requests = make_workload(settings.workload, settings.model.vocab_size)
    kv = _kv_summary(settings, engine, requests)
    _print_header(settings, kv, out)
    plain = _run_plain(engine, requests, _Progress("without ems", len(requests), progress))
    del engine
    forwarded: list[str] = []
    for dest in _FORWARDED:
        forwarded += [f"--{dest.replace('_', '-')}", str(getattr(args, dest))]
    forwarded.append("--progress" if progress else "--no-progress")
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(ems.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    report: dict[str, Any] = {"settings": vars(args), "kv": kv, "plain": _pass_json(plain),
                              "instances": []}
    ok = True
    with tempfile.TemporaryDirectory(prefix="ems-demo-") as tmp:
        for i in range(args.instances):
            path = os.path.join(tmp, f"instance{i}.pt")
            rc = subprocess.run([sys.executable, "-m", "ems.demo", *forwarded,
                                 "--worker-out", path,
                                 "--worker-label", f"instance {i + 1}/{args.instances}"],
                                env=env, check=False).returncode
            if rc != 0:
                print(f"ems demo: instance {i + 1} failed (exit {rc})", file=sys.stderr)
                return 1
            data = torch.load(path, weights_only=True)
            cached = [RequestStats(**r, logits=lg)
                      for r, lg in zip(data["requests"], data["logits"])]
            cmp = compare(plain, cached, settings.atol)
            ok = ok and cmp.ok
            _print_summary(f"[instance {i + 1}] ", _totals(plain), _totals(cached),
                           data["connector"], kv["block_bytes"], cmp, out)
            report["instances"].append({"ems": _pass_json(cached),
                                        "connector": data["connector"],
                                        "comparison": dataclasses.asdict(cmp) | {"ok": cmp.ok}})
    report["ok"] = ok
    if args.json:
        _write_json(args.json, report)
    return 0 if ok else 1


# ----------------------------------------------------------------------- main

def _run_single(settings: DemoSettings, args: argparse.Namespace,
                progress: bool, out: TextIO) -> int:
    engine = _engine(settings)
    requests = make_workload(settings.workload, settings.model.vocab_size)
    kv = _kv_summary(settings, engine, requests)
    _print_header(settings, kv, out)
    plain = _run_plain(engine, requests, _Progress("without ems", len(requests), progress))
    try:
        run = _run_cached(engine, settings, requests,
                          _Progress("with ems", len(requests), progress))
    except EmsException as exc:
        print(f"ems demo: could not use ems ({exc.status_code().name}): {exc.message()}",
              file=sys.stderr)
        return 1
    cmp = compare(plain, run.results, settings.atol)
    _print_requests(plain, run.results, out)
    _print_summary("", _totals(plain), _totals(run.results), run.connector,
                   kv["block_bytes"], cmp, out)
    if run.pool:
        print("pool statistics: " + ", ".join(f"{k} {v}" for k, v in run.pool.items()),
              file=out)
    if args.json:
        _write_json(args.json, {
            "settings": vars(args), "model": dataclasses.asdict(settings.model),
            "model_id": settings.model_id, "kv": kv,
            "plain": _pass_json(plain), "ems": _pass_json(run.results),
            "connector": run.connector, "pool_statistics": run.pool,
            "comparison": dataclasses.asdict(cmp) | {"ok": cmp.ok}, "ok": cmp.ok})
    return 0 if cmp.ok else 1


def main(argv: Optional[list[str]] = None, out: Optional[TextIO] = None) -> int:
    """Run ``ems demo`` with ``argv`` (default ``sys.argv[1:]``); the exit status.

    0: outputs identical; 1: they differ (or ems could not be used); 2: bad
    arguments, or ``--instances`` without the ems-server daemon. The report goes to
    ``out`` (default stdout), the progress bar to stderr.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    out = sys.stdout if out is None else out
    try:
        settings = _settings(args)
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"ems demo: error: {exc}", file=sys.stderr)
        return 2
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.worker_out:
            return _worker(settings, args.worker_out, args.worker_label, progress)
        if args.hosts > 1:
            from ems.demo.hosts import run_hosts
            return run_hosts(settings, args, progress, out)
        if args.instances > 1:
            return _run_instances(settings, args, progress, out)
        return _run_single(settings, args, progress, out)
    finally:
        torch.set_num_threads(threads)
