"""``ems bench``: the command line, the set-up and tear-down of every system, the run.

Usage (``ems bench --help``)::

    bash benchmarks/setup-peers.sh          # once: Redis, Mooncake Store, matplotlib
    ems bench                               # everything, about 5-10 minutes
    ems bench --quick                       # smaller sizes, under 2 minutes
    ems bench --quick --systems embedded    # no daemon, no peers (the smoke test)
    ems bench --disk                        # the disk tier (ems.bench.disk), ~2 minutes
    ems bench --trace FILE --capacities 1000,10000   # a trace replay (ems.bench.trace)

It prints a Markdown table (GB/s, ratio to memcpy), and writes ``bench.json`` and
``bench.png`` into ``--out``. Every process it starts (ems-server, mooncake_master,
mooncake_client, redis-server) runs in a temp dir on loopback / unix sockets and is
stopped by PID at the end, on an error and on Ctrl-C. A system that cannot run is
listed with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Optional, Sequence

from ems.bench import procs
from ems.bench.report import commit, table, to_json, write_json
from ems.bench.systems import (
    EmsDaemon,
    EmsSystem,
    LimitSystem,
    MemcpySystem,
    MooncakeService,
    MooncakeSystem,
    RedisService,
    RedisSystem,
    Unavailable,
    lmcache_unavailable_reason,
)
from ems.bench.workloads import WORKLOADS, Context, Params, max_batch_bytes, run, steps
from ems.progress import Progress

__all__ = ["main", "SYSTEMS", "PEERS"]

SYSTEMS = ("memcpy", "ems-embedded", "ems-daemon", "mooncake", "redis", "lmcache", "cluster",
           "mooncake-tcp")
#: "cluster": ems across two simulated hosts on a local Valkey Cluster, valkey-py on the
#: same cluster (ems.bench.cluster; needs the cluster extra) and Mooncake Store over TCP
#: between two processes ("mooncake-tcp", ems.bench.mooncake_tcp; also on its own)
PEERS = ("mooncake", "redis", "lmcache", "cluster", "mooncake-tcp")
_ALIASES = {"embedded": "ems-embedded", "daemon": "ems-daemon", "server": "ems-daemon",
            "ems-server": "ems-daemon"}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ems bench",
        description="Throughput and latency of ems against memcpy, Mooncake Store and "
                    "Redis, side by side in one run. Set up the peers first with "
                    "'bash benchmarks/setup-peers.sh'.")
    ap.add_argument("--quick", action="store_true",
                    help="smaller sizes and fewer repetitions (under 2 minutes)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma list of: " + ", ".join(SYSTEMS) + " (also 'embedded', "
                         "'daemon'); memcpy is always measured (default: all)")
    ap.add_argument("--no-peers", action="store_true",
                    help="only memcpy and ems (drop " + ", ".join(PEERS) + ")")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma list of: " + ", ".join(WORKLOADS) + " (default: all)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions per case (default 9, --quick 3)")
    ap.add_argument("--out", default="bench-results",
                    help="directory for bench.json and bench.png (default ./bench-results)")
    ap.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temp dir with the logs of the processes it started")
    from ems.bench.disk import add_arguments
    add_arguments(ap)
    from ems.bench import trace
    trace.add_arguments(ap)
    return ap


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    out = []
    for raw in text.split(","):
        name = _ALIASES.get(raw.strip().lower(), raw.strip().lower())
        if not name:
            continue
        if name not in known:
            raise SystemExit(f"ems bench: unknown {what} {raw!r}; choose from "
                             f"{', '.join(known)}")
        if name not in out:
            out.append(name)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the bench; returns the process exit code (0: ran, problems are reported)."""
    args = _parser().parse_args(argv)
    if args.trace:
        from ems.bench import trace
        return trace.main(args, list(argv) if argv is not None else sys.argv[1:])
    if args.disk:
        from ems.bench import disk
        return disk.main(args, list(argv) if argv is not None else sys.argv[1:])
    want = _names(args.systems, SYSTEMS, "system")
    if args.no_peers:
        want = [s for s in want if s not in PEERS]
    if "memcpy" not in want:
        want.insert(0, "memcpy")  # every ratio needs it
    workloads = _names(args.workloads, WORKLOADS, "workload")
    params = Params.quick() if args.quick else Params.full()
    if args.reps is not None:
        if args.reps < 1:
            raise SystemExit("ems bench: --reps must be >= 1")
        params = dataclasses.replace(params, reps=args.reps)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.makedirs(args.out, exist_ok=True)

    started = datetime.datetime.now(datetime.timezone.utc)
    ems_at_start = commit()
    t0 = time.monotonic()
    restore = procs.install_signal_handlers()
    work_dir = tempfile.mkdtemp(prefix="ems-bench-")
    progress = Progress(1, enabled=not args.no_progress)
    ctx = Context(params, {}, progress, work_dir, set(want))
    peers: dict[str, Any] = {}
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(ctx.drop_buffers)
            _start_systems(ctx, stack, want, peers)
            progress.set_total(steps(workloads, params, list(ctx.systems), ctx.want))
            for w in workloads:
                try:
                    run(ctx, w)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as exc:  # noqa: BLE001 - one workload, not the run
                    traceback.print_exc()
                    ctx.problem("bench", w, f"{type(exc).__name__}: {exc}")
            progress.close()
    except KeyboardInterrupt:
        progress.close()
        print("ems bench: interrupted; every process it started was stopped",
              file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        restore()
        if args.keep:
            print(f"ems bench: logs kept in {work_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)

    elapsed = time.monotonic() - t0
    data = to_json(ctx, {"argv": list(argv) if argv is not None else sys.argv[1:],
                         "quick": args.quick, "systems": want, "workloads": workloads,
                         "params": dataclasses.asdict(params)}, peers, started, elapsed,
                   ems_at_start)
    json_path = os.path.join(args.out, "bench.json")
    write_json(json_path, data)
    print(f"# ems bench, {data['date']}, {elapsed:.0f} s, ems {data['ems'].get('commit', '')}"
          f"{' (dirty)' if data['ems'].get('dirty') else ''}")
    print(table(ctx))
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        png = os.path.join(args.out, "bench.png")
        why = _plot(data, png)
        print(f"wrote {png}" if why is None else f"no plot: {why}")
    return 0 if ctx.rows else 1


def _why(exc: Exception) -> str:
    """A system's setup failure as its problem line (``Unavailable`` says why itself)."""
    return str(exc) if isinstance(exc, Unavailable) else f"{type(exc).__name__}: {exc}"


def _start_mooncake_tcp(ctx: Context, stack: contextlib.ExitStack,
                        peers: dict[str, Any]) -> None:
    """The cross-host Mooncake rows, one per layout (master + host A + host B, and for
    ``mooncake-tcp-node`` a store node); a failure is a problem, reported."""
    from ems.bench.mooncake_tcp import LAYOUTS, MooncakeTcpSystem
    for layout, name in LAYOUTS.items():
        try:
            system = MooncakeTcpSystem(ctx.work_dir, ctx.params.capacity_bytes,
                                       layout=layout)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
            ctx.problem(name, "setup", _why(exc))
            continue
        stack.callback(system.close)
        ctx.systems[system.name] = system
        peers[system.name] = system.info()


def _plot(data: dict[str, Any], path: str) -> Optional[str]:
    from ems.bench.plot import plot
    return plot(data, path)


def _start_systems(ctx: Context, stack: contextlib.ExitStack, want: list[str],
                   peers: dict[str, Any]) -> None:
    p = ctx.params
    batch = max_batch_bytes(p)
    memcpy = MemcpySystem(batch)
    ctx.systems["memcpy"] = memcpy
    stack.callback(memcpy.close)
    for kernel in ("nt", "glibc"):  # the limit: the best copy of the same runs
        try:
            limit = LimitSystem(batch, kernel)
        except Unavailable as exc:
            ctx.problem(f"copy-{kernel}", "all", str(exc))
            continue
        ctx.systems[limit.name] = limit
        stack.callback(limit.close)
    for name in want:
        if name == "memcpy":
            continue
        try:
            if name == "ems-embedded":
                system: Any = EmsSystem("embedded", p.capacity_bytes)
            elif name == "ems-daemon":
                d = os.path.join(ctx.work_dir, "ems")
                ctx.daemon = EmsDaemon(d, p.capacity_bytes, ctx.work_dir)
                stack.callback(ctx.daemon.close)
                system = EmsSystem("daemon", p.capacity_bytes, socket_dir=d)
            elif name == "mooncake":
                svc = MooncakeService(p.capacity_bytes, ctx.work_dir)
                stack.callback(svc.close)
                system = MooncakeSystem(svc.client_address, 2 * batch + 16 * (1 << 20),
                                        p.capacity_bytes)
                ctx.mooncake_address = svc.client_address
                peers["mooncake"] = {
                    "path": "same-host shared memory: mooncake_client owns the segment, "
                            "dummy client, alloc_from_mem_pool + register_buffer, "
                            "zero-copy batch_put_from / batch_get_into",
                    "global_segment_bytes": p.capacity_bytes,
                    "client_threads": os.cpu_count() or 1}
            elif name == "redis":
                rsvc = RedisService(ctx.work_dir)
                stack.callback(rsvc.close)
                system = RedisSystem(rsvc.socket_path)
                ctx.redis_socket = rsvc.socket_path
                peers["redis"] = {"server": rsvc.version, "path": "unix socket, redis-py "
                                  "+ hiredis, pipelined SET / GET (transaction=False)"}
            elif name == "lmcache":
                raise Unavailable(lmcache_unavailable_reason())
            elif name == "cluster":
                from ems.bench.cluster import ClusterHosts, CrossHostSystem, ValkeyPySystem
                hosts = ClusterHosts(os.path.join(ctx.work_dir, "cluster"), p.capacity_bytes)
                stack.callback(hosts.close)
                try:
                    peer: Any = ValkeyPySystem(hosts)
                    ctx.systems[peer.name] = peer
                    stack.callback(peer.close)
                except Unavailable as exc:
                    ctx.problem("valkey-py", "setup", str(exc))
                if "mooncake-tcp" not in want:  # the cross-host peer runs with it
                    _start_mooncake_tcp(ctx, stack, peers)
                system = CrossHostSystem(hosts, p.capacity_bytes)
                name = system.name
            elif name == "mooncake-tcp":
                _start_mooncake_tcp(ctx, stack, peers)
                continue
            else:  # pragma: no cover - _names filters
                continue
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
            ctx.problem(name, "setup", _why(exc))
            continue
        ctx.systems[name] = system
        stack.callback(system.close)
