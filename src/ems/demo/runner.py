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

``--disk`` starts its own daemons, with a pool smaller than the working set: the hit
rate without and with the disk tier, and after a restart (``ems.demo.disk``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from typing import Any, Optional, TextIO

import torch

from ems import Ems, EmsException
from ems.config import PoolSettings
from ems.demo import passes
from ems.demo.engine import Workload, make_workload
from ems.demo.model import ModelConfig
from ems.demo.passes import DemoSettings

__all__ = ["main"]

# ------------------------------------------------------------------- settings

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
    r.add_argument("--disk", action="store_true",
                   help="the daemon's disk tier: an ems-server whose shared memory is "
                        "smaller than the working set, without and with --disk, then "
                        "restarted; see ems.demo.disk")
    r.add_argument("--disk-shm-mib", type=int, default=0,
                   help="with --disk: the daemon's shared memory, MiB (0: half the "
                        "workload's KV)")
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
    if args.disk_shm_mib < 0:
        raise ValueError("--disk-shm-mib must be >= 0")
    if args.disk and (args.instances > 1 or args.hosts > 1):
        raise ValueError("--disk runs its own passes; drop --instances and --hosts")
    if args.timeout_ms < 0 or args.atol < 0:
        raise ValueError("--timeout-ms and --atol must be >= 0")
    model = ModelConfig.for_hidden(args.hidden, num_layers=args.layers, vocab_size=args.vocab,
                                   num_heads=args.heads, num_kv_heads=args.kv_heads,
                                   seed=args.seed)
    workload = Workload(args.prefixes, args.requests, args.prefix_tokens, args.suffix_tokens,
                        args.decode_tokens, args.seed)
    return DemoSettings(model, workload, args.block_size, args.timeout_ms, args.atol)


# ------------------------------------------------------------------ instances

def _worker(settings: DemoSettings, out_path: str, label: str, progress: bool) -> int:
    """A ``--instances`` worker: the ems pass only; results to ``out_path`` (torch.save)."""
    engine = passes.make_engine(settings)
    requests = make_workload(settings.workload, settings.model.vocab_size)
    with passes.progress(label, len(requests), progress) as step:
        run = passes.run_cached(engine, settings, requests, step)
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
        passes.init_cc(settings)
    except EmsException as exc:
        print(f"ems demo: cannot use the pool ({exc.status_code().name}): {exc.message()}",
              file=sys.stderr)
        return 1
    finally:
        Ems.finalize()
    engine = passes.make_engine(settings)
    requests = make_workload(settings.workload, settings.model.vocab_size)
    kv = passes.kv_summary(settings, engine, requests)
    passes.print_header(settings, kv, out)
    with passes.progress("without ems", len(requests), progress) as step:
        plain = passes.run_plain(engine, requests, step)
    del engine
    argv, env = passes.worker_args(args, progress), passes.worker_env()
    report: dict[str, Any] = {"settings": vars(args), "kv": kv,
                              "plain": passes.pass_json(plain),
                              "instances": []}
    ok = True
    with tempfile.TemporaryDirectory(prefix="ems-demo-") as tmp:
        for i in range(args.instances):
            run = passes.run_instance(settings, plain, kv, argv, env,
                                      os.path.join(tmp, f"instance{i}.pt"),
                                      f"instance {i + 1}/{args.instances}", out)
            if run is None:
                return 1
            ok = ok and run.comparison.ok
            report["instances"].append(run.to_json())
    report["ok"] = ok
    if args.json:
        passes.write_json(args.json, report)
    return 0 if ok else 1


# ----------------------------------------------------------------------- main

def _run_single(settings: DemoSettings, args: argparse.Namespace,
                progress: bool, out: TextIO) -> int:
    engine = passes.make_engine(settings)
    requests = make_workload(settings.workload, settings.model.vocab_size)
    kv = passes.kv_summary(settings, engine, requests)
    passes.print_header(settings, kv, out)
    with passes.progress("without ems", len(requests), progress) as step:
        plain = passes.run_plain(engine, requests, step)
    try:
        with passes.progress("with ems", len(requests), progress) as step:
            run = passes.run_cached(engine, settings, requests, step)
    except EmsException as exc:
        print(f"ems demo: could not use ems ({exc.status_code().name}): {exc.message()}",
              file=sys.stderr)
        return 1
    cmp = passes.compare(plain, run.results, settings.atol)
    passes.print_requests(plain, run.results, out)
    passes.print_summary("", passes.totals(plain), passes.totals(run.results), run.connector,
                         kv["block_bytes"], cmp, out)
    if run.pool:
        print("pool statistics: " + ", ".join(f"{k} {v}" for k, v in run.pool.items()),
              file=out)
    if args.json:
        passes.write_json(args.json, {
            "settings": vars(args), "model": dataclasses.asdict(settings.model),
            "model_id": settings.model_id, "kv": kv,
            "plain": passes.pass_json(plain), "ems": passes.pass_json(run.results),
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
        if args.disk:
            from ems.demo.disk import run_disk
            return run_disk(settings, args, progress, out)
        if args.hosts > 1:
            from ems.demo.hosts import run_hosts
            return run_hosts(settings, args, progress, out)
        if args.instances > 1:
            return _run_instances(settings, args, progress, out)
        return _run_single(settings, args, progress, out)
    finally:
        torch.set_num_threads(threads)
