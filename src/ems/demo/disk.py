"""``ems demo --disk``: a shared-memory pool smaller than the working set, with and
without the daemon's disk tier, and across a restart.

It runs the pass without ems in this process, then three ems passes as instances (the
``--instances`` workers), each checked against it:

1. **shared memory only**: an ``ems-server`` whose pool holds half the workload's KV
   blocks (``--disk-shm-mib`` to choose). The requests of the prefixes arrive
   interleaved, so a prefix's blocks are evicted before its next request: most of
   them are computed again.
2. **with --disk**: the same pool plus ``--disk DIR``: the evicted blocks are read
   back from the disk.
3. **after a restart**: that daemon stopped (SIGTERM) and started again on the same
   directory, shared memory empty: the pass still finds the blocks, on the disk.

It prints one row per pass (hit rate, the daemon's shared-memory and disk hits,
prefill time, outputs) and, with ``--json``, writes the figures. Everything it
started is stopped at the end, also on error; the disk directory is a temp dir.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from typing import Any, Optional, TextIO

from ems.demo import passes
from ems.demo.engine import make_workload
from ems.demo.passes import DemoSettings
from ems.protocol.report import DaemonReport, DiskTenantRow, Wire

__all__ = ["run_disk"]

MiB = 1 << 20


def _counters(wire: Wire) -> dict[str, int]:
    """A tenant's pool counters; ``hits`` are shared memory's, ``disk_hits`` the disk's."""
    row = DaemonReport.from_wire(wire).tenants["(anonymous)"]
    disk = row.tiers.disk or DiskTenantRow()
    return {"hits": row.hits, "misses": row.misses, "evictions": row.evictions,
            "disk_hits": disk.hits, "disk_objects": disk.objects}


def _pass(settings: DemoSettings, plain: Any, kv: dict[str, Any], argv: list[str],
          server: Any, path: str, label: str, out: TextIO) -> Optional[dict[str, Any]]:
    """One ems pass as an instance on ``server``; its figures (None: it failed)."""
    before = _counters(server.stats())
    run = passes.run_instance(settings, plain, kv, argv,
                              passes.worker_env(server.client_env()), path, label, out)
    if run is None:
        return None
    after = _counters(server.stats())
    t = passes.totals(run.results)
    delta = {k: after[k] - before[k] for k in ("hits", "misses", "evictions", "disk_hits")}
    return {"label": label, "hit_rate": t["loaded_tokens"] / max(t["prompt_tokens"], 1),
            "prefill_s": t["prefill_s"], "loaded_tokens": t["loaded_tokens"],
            "prompt_tokens": t["prompt_tokens"], "pool": delta,
            "disk_objects": after["disk_objects"], "ok": run.comparison.ok,
            **run.to_json()}


def _table(plain_s: float, rows: list[dict[str, Any]], out: TextIO) -> None:
    print(f"\n{'pass':<22}{'hit rate':>9}{'shm hits':>10}{'disk hits':>10}"
          f"{'evictions':>10}{'prefill s':>10}  outputs", file=out)
    print(f"{'without ems':<22}{'-':>9}{'-':>10}{'-':>10}{'-':>10}{plain_s:>10.2f}  "
          "(reference)", file=out)
    for r in rows:
        p = r["pool"]
        print(f"{r['label']:<22}{r['hit_rate']:>9.1%}{p['hits']:>10}"
              f"{p['disk_hits']:>10}{p['evictions']:>10}{r['prefill_s']:>10.2f}  "
              f"{'identical' if r['ok'] else 'DIFFER'}", file=out)


def run_disk(settings: DemoSettings, args: argparse.Namespace, progress: bool,
             out: TextIO) -> int:
    from ems.testing import run_server
    engine = passes.make_engine(settings)
    requests = make_workload(settings.workload, settings.model.vocab_size)
    kv = passes.kv_summary(settings, engine, requests)
    # The daemon's floor is 1 MiB of shared memory: a workload below 2 MiB of KV would
    # fit whole, so say so in the header (print_header warns only when it does not).
    shm = args.disk_shm_mib * MiB if args.disk_shm_mib else max(
        MiB, kv["distinct_bytes"] // 2)
    kv.update(pool="ems-server, shared memory smaller than the working set",
              pool_capacity_bytes=shm)
    passes.print_header(settings, kv, out)
    with passes.progress("without ems", len(requests), progress) as step:
        plain = passes.run_plain(engine, requests, step)
    del engine
    argv = passes.worker_args(args, progress)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ems-demo-disk-") as tmp, \
            contextlib.ExitStack() as stack:
        disk_dir = os.path.join(tmp, "disk")
        plans = [("shared memory only", "shm", []),
                 ("with --disk", "disk", ["--disk", disk_dir, "--disk-checkpoint-s", "1"])]
        for label, name, extra in plans:
            d = os.path.join(tmp, name)
            os.makedirs(d)
            server = stack.enter_context(run_server(d, capacity=str(shm), extra_args=extra))
            row = _pass(settings, plain, kv, argv, server, os.path.join(tmp, f"{name}.pt"),
                        label, out)
            if row is None:
                return 1
            rows.append(row)
        server.restart()  # SIGTERM (flush, checkpoint, clean mark), then a fresh start
        recovered = server.disk_after_recovery().records_recovered
        print(f"[after restart] the daemon recovered {recovered} records from the disk",
              file=out)
        row = _pass(settings, plain, kv, argv, server, os.path.join(tmp, "restart.pt"),
                    "after restart", out)
        if row is None:
            return 1
        row["records_recovered"] = recovered
        rows.append(row)
    _table(passes.totals(plain)["prefill_s"], rows, out)
    ok = all(r["ok"] for r in rows)
    if args.json:
        passes.write_json(args.json, {
            "settings": vars(args), "kv": kv, "shm_bytes": shm,
            "plain": passes.pass_json(plain), "passes": rows,
            "hit_rate": {"shm_only": rows[0]["hit_rate"], "disk": rows[1]["hit_rate"],
                         "after_restart": rows[2]["hit_rate"]}, "ok": ok})
    return 0 if ok else 1
