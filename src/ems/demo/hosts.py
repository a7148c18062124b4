"""``ems demo --hosts 2``: two simulated hosts on one Valkey Cluster.

It starts a local 3-primary Valkey Cluster (``ems.cluster.launcher``, 127.0.0.1) and
one ``ems-server --cluster`` per host, each with its own socket dir (its own local
pool), then runs the ems pass as an instance on host 1, then one on host 2, ... (the
``--instances`` workers, each pointed at its host's daemon). Host 1 computes and
saves; host 2's local pool is empty, so its hits come through the cluster (and fill
its read cache). Every instance's outputs are checked against the pass without ems;
per host it prints the hit rate of each tier (local pool, cluster) from its daemon's
counters. Everything it started is stopped at the end, also on error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
from typing import Any, TextIO

from ems.demo import passes
from ems.demo.engine import make_workload
from ems.demo.passes import DemoSettings
from ems.protocol.report import DaemonReport, Wire

__all__ = ["run_hosts"]


def _tiers(wire: Wire) -> dict[str, Any]:
    report = DaemonReport.from_wire(wire)
    local = report.tenants["(anonymous)"]
    assert report.cluster is not None, "the demo's daemons run a cluster tier"
    tier = report.cluster.tier
    return {"local_hits": local.hits, "local_misses": local.misses,
            "local_hit_rate": local.hit_rate,
            "cluster_hits": tier.hits, "cluster_misses": tier.misses,
            "cluster_hit_rate": tier.hit_rate, "cluster_bytes_in": tier.bytes_in,
            "cluster_bytes_out": tier.bytes_out}


def run_hosts(settings: DemoSettings, args: argparse.Namespace, progress: bool,
              out: TextIO) -> int:
    try:
        from ems.cluster import launcher
        from ems.testing import run_server
        launcher.server_binary()
    except Exception as exc:  # noqa: BLE001 - the message says what to install
        print(f"ems demo: --hosts needs the cluster extra: {exc}", file=sys.stderr)
        return 2
    engine = passes.make_engine(settings)
    requests = make_workload(settings.workload, settings.model.vocab_size)
    kv = passes.kv_summary(settings, engine, requests)
    kv.update(pool=f"one ems-server per host ({args.hosts}) + a local Valkey Cluster",
              pool_capacity_bytes=None)
    passes.print_header(settings, kv, out)
    with passes.progress("without ems", len(requests), progress) as step:
        plain = passes.run_plain(engine, requests, step)
    del engine
    argv = passes.worker_args(args, progress)
    report: dict[str, Any] = {"settings": vars(args), "kv": kv,
                              "plain": passes.pass_json(plain), "hosts": []}
    ok = True
    capacity = f"{max(64, 2 * kv['distinct_bytes'] >> 20)}M"  # every block fits each host
    with tempfile.TemporaryDirectory(prefix="ems-demo-hosts-") as tmp, \
            contextlib.ExitStack() as stack:
        # SIGTERM (a CI timeout, a kill from a terminal): unwind, so the cluster and the
        # daemons started below are stopped by the stack, not left behind
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        stack.callback(signal.signal, signal.SIGTERM, previous)
        cluster = launcher.up(os.path.join(tmp, "valkey"), nodes=3)
        stack.callback(cluster.stop)
        print(f"cluster: {cluster.seed} (3 primaries on 127.0.0.1)", file=out)
        servers = []
        for h in range(args.hosts):
            d = os.path.join(tmp, f"host{h + 1}")
            os.makedirs(d)
            servers.append(stack.enter_context(run_server(
                d, capacity=capacity, extra_args=["--cluster", cluster.seed])))
        for h, server in enumerate(servers):
            run = passes.run_instance(settings, plain, kv, argv,
                                      passes.worker_env(server.client_env()),
                                      os.path.join(tmp, f"host{h + 1}.pt"),
                                      f"host {h + 1}/{args.hosts}", out)
            if run is None:
                return 1
            ok = ok and run.comparison.ok
            tiers = _tiers(server.stats())
            print(f"[host {h + 1}] tiers: local pool {100 * tiers['local_hit_rate']:.1f}% "
                  f"hits ({tiers['local_hits']}/{tiers['local_hits'] + tiers['local_misses']} "
                  f"lookups), cluster {100 * tiers['cluster_hit_rate']:.1f}% hits "
                  f"({tiers['cluster_hits']}/{tiers['cluster_hits'] + tiers['cluster_misses']}"
                  f" blocks), {tiers['cluster_bytes_in'] / 2**20:.1f} MiB in, "
                  f"{tiers['cluster_bytes_out'] / 2**20:.1f} MiB out", file=out)
            report["hosts"].append(run.to_json() | {"tiers": tiers})
    report["ok"] = ok
    if args.json:
        passes.write_json(args.json, report)
    return 0 if ok else 1
