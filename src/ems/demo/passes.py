"""The passes of ``ems demo`` that its single run, its ``--instances`` and its
``--hosts`` share: the settings, the engine, the pass without ems and the pass with
it, an instance in a worker process, comparing the outputs, and the report.

``runner`` (the command line, one run, ``--instances``) and ``hosts`` (``--hosts``)
both build on this module; neither imports the other's internals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional, TextIO

import torch

import ems
from ems import CcConfig_v1, Ems, EmsConfig, EmsException
from ems.config import PoolSettings
from ems.demo.connector import EmsConnector
from ems.demo.engine import Engine, RequestStats, Workload, make_workload
from ems.demo.model import LlamaModel, ModelConfig
from ems.demo.scheduler import Request, block_hashes
from ems.progress import Progress

__all__ = ["CachedRun", "Comparison", "DemoSettings", "FORWARDED", "InstanceRun", "compare",
           "init_cc", "kv_summary", "make_engine", "pass_json", "print_header",
           "print_requests", "print_summary", "progress", "run_cached", "run_instance",
           "run_plain", "totals", "worker_args", "worker_env", "write_json"]

#: Options a ``--instances`` worker is started with (dest names of the parser).
FORWARDED = ("prefixes", "requests", "prefix_tokens", "suffix_tokens", "decode_tokens",
              "layers", "hidden", "heads", "kv_heads", "vocab", "block_size", "seed",
              "threads", "timeout_ms")



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

def make_engine(settings: DemoSettings) -> Engine:
    """Model and engine, warmed up so the first timed request pays no start-up cost."""
    engine = Engine(LlamaModel(settings.model), settings.num_blocks, settings.block_size)
    warm = make_workload(dataclasses.replace(settings.workload, prefixes=1, requests=1,
                                             seed=settings.workload.seed + 1),
                         settings.model.vocab_size)
    engine.run_all(warm)
    engine.reset()
    return engine


def init_cc(settings: DemoSettings) -> Any:
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
class CachedRun:
    results: list[RequestStats]
    connector: dict[str, Any]
    pool: Optional[dict[str, Any]]


def run_cached(engine: Engine, settings: DemoSettings, requests: Sequence[Request],
                progress: Callable[[RequestStats], None]) -> CachedRun:
    """The ems pass: init, register, run every request, collect saves, finalize."""
    cc = init_cc(settings)
    try:
        connector = EmsConnector(cc, settings.block_size, settings.timeout_ms)
        engine.attach(connector)
        results = engine.run_all(requests, progress)
        connector.wait_all()
        pool = None
        if hasattr(cc, "statistics"):
            stats = cc.statistics()
            pool = (dataclasses.asdict(stats)  # type: ignore[arg-type]
                    if dataclasses.is_dataclass(stats) else None)
        return CachedRun(results, dataclasses.asdict(connector.stats), pool)
    finally:
        engine.attach(None)
        Ems.finalize()


def run_plain(engine: Engine, requests: Sequence[Request],
              progress: Callable[[RequestStats], None]) -> list[RequestStats]:
    """The pass without ems: every request prefills its whole prompt."""
    results = engine.run_all(requests, progress)
    engine.reset()
    return results


# ------------------------------------------------------------------ reporting

def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def kv_summary(settings: DemoSettings, engine: Engine,
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


def print_header(settings: DemoSettings, kv: dict[str, Any], out: TextIO) -> None:
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
          f"full blocks = {mib(kv['distinct_bytes'])}; pool: {kv['pool']}"
          + (f", capacity {mib(cap)}" if cap else ""), file=out)
    if cap is not None and kv["distinct_bytes"] > cap:
        print(f"warning: the workload's KV ({mib(kv['distinct_bytes'])}) exceeds the pool "
              f"capacity ({mib(cap)}): expect evictions and fewer hits (EMS_CAPACITY)",
              file=out)


def totals(results: Sequence[RequestStats]) -> dict[str, float]:
    return {
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "loaded_tokens": sum(r.loaded_tokens for r in results),
        "computed_tokens": sum(r.computed_tokens for r in results),
        "prefill_s": sum(r.prefill_s for r in results),
        "load_s": sum(r.load_s for r in results),
        "decode_s": sum(r.decode_s for r in results),
        "save_wait_s": sum(r.save_wait_s for r in results),
    }


def print_requests(plain: Sequence[RequestStats], cached: Sequence[RequestStats],
                    out: TextIO) -> None:
    print(f"\n{'request':<10}{'prompt':>7}{'loaded':>8}{'computed':>9}"
          f"{'plain ms':>10}{'ems ms':>9}{'speedup':>9}  same", file=out)
    for a, b in zip(plain, cached):
        same = "yes" if a.output == b.output else "NO"
        print(f"{a.request_id:<10}{a.prompt_tokens:>7}{b.loaded_tokens:>8}"
              f"{b.computed_tokens:>9}{a.prefill_s * 1e3:>10.1f}{b.prefill_s * 1e3:>9.1f}"
              f"{a.prefill_s / max(b.prefill_s, 1e-9):>8.2f}x  {same}", file=out)


def print_summary(label: str, plain: dict[str, float], cached: dict[str, float],
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
    print(f"{label}bytes moved: loaded {mib(loaded_b)} in {conn['load_s']:.3f} s "
          f"({rate:.2f} GB/s), saved {mib(saved_b)} ({conn['blocks_saved']} blocks, "
          f"{conn['blocks_save_failed']} failed; waited {conn['save_wait_s']:.3f} s); "
          f"lookups {conn['lookup_s']:.3f} s; errors {conn['errors']}", file=out)
    verdict = "OK" if cmp.ok else "MISMATCH"
    print(f"{label}outputs: {cmp.same_tokens}/{cmp.requests} requests chose identical greedy "
          f"tokens; max |logit diff| {cmp.max_logit_diff:.2e} (atol {cmp.atol:g})  ->  "
          f"{verdict}", file=out)
    if cmp.mismatched:
        print(f"{label}differing requests: {', '.join(cmp.mismatched)}", file=out)


def pass_json(results: Sequence[RequestStats]) -> dict[str, Any]:
    return {"totals": totals(results), "requests": [r.to_json() for r in results]}


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


# ------------------------------------------------------------------- progress

@contextlib.contextmanager
def progress(label: str, total: int, enabled: bool) -> Iterator[Callable[[RequestStats], None]]:
    """A pass's progress bar (``ems.progress``): the callback to call per request."""
    bar = Progress(total, enabled, name="demo")
    try:
        yield lambda _stats: bar.step(label)
    finally:
        bar.close()


# ------------------------------------------------------------------ instances

def worker_args(args: Any, show_progress: bool) -> list[str]:
    """The command-line options an instance's worker process is started with."""
    out: list[str] = []
    for dest in FORWARDED:
        out += [f"--{dest.replace('_', '-')}", str(getattr(args, dest))]
    out.append("--progress" if show_progress else "--no-progress")
    return out


def worker_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """This environment (plus ``extra``), with this very ``ems`` on the path."""
    env = dict(os.environ, **(extra or {}))
    src = os.path.dirname(os.path.dirname(os.path.abspath(ems.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


@dataclasses.dataclass
class InstanceRun:
    """One instance's ems pass, compared with the pass without ems."""

    results: list[RequestStats]
    connector: dict[str, Any]
    comparison: Comparison

    def to_json(self) -> dict[str, Any]:
        return {"ems": pass_json(self.results), "connector": self.connector,
                "comparison": dataclasses.asdict(self.comparison) | {"ok": self.comparison.ok}}


def run_instance(settings: DemoSettings, plain: Sequence[RequestStats], kv: dict[str, Any],
                 argv: Sequence[str], env: dict[str, str], out_path: str, label: str,
                 out: TextIO) -> Optional[InstanceRun]:
    """Run the ems pass in a worker process (``python -m ems.demo ... --worker-out``),
    compare its outputs with ``plain`` and print its summary, each line starting with
    ``[label]``; None (and a line on stderr) if the worker failed."""
    rc = subprocess.run([sys.executable, "-m", "ems.demo", *argv, "--worker-out", out_path,
                         "--worker-label", label], env=env, check=False).returncode
    if rc != 0:
        print(f"ems demo: {label} failed (exit {rc})", file=sys.stderr)
        return None
    data = torch.load(out_path, weights_only=True)
    cached = [RequestStats(**q, logits=lg) for q, lg in zip(data["requests"], data["logits"])]
    cmp = compare(plain, cached, settings.atol)
    print_summary(f"[{label.split('/')[0]}] ", totals(plain), totals(cached), data["connector"],
                  kv["block_bytes"], cmp, out)
    return InstanceRun(cached, data["connector"], cmp)
