"""Results as a table (GB/s, ratio to the limit and to memcpy), as JSON, and the
targets as data.

Ratios compare systems measured side by side in one run. The limit of a row is the
faster of the two best copy kernels (``copy-nt``, ``copy-glibc``) over the same runs
between pre-faulted buffers, in the same workload, case and op (:func:`limit_ratio`,
"x limit"); the numpy ``copyto`` row stays as a second, labelled column
(:func:`ratio`, "x memcpy"; for scaling it is the only baseline: memcpy with the same
number of processes). Absolute GB/s on a shared machine are noise; ratios are not.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ems.bench.workloads import Context, Latency, Row

__all__ = ["limit_ratio", "ratio", "targets", "table", "to_json", "machine", "commit",
           "guarded_run"]

_LIMITS = ("copy-nt", "copy-glibc")


def ratio(ctx: Context, row: Row) -> Optional[float]:
    """``row`` against numpy's memcpy of the same runs."""
    for r in ctx.rows:
        if (r.system == "memcpy" and r.workload == row.workload and r.case == row.case
                and r.op == row.op and r.gbps > 0):
            return row.gbps / r.gbps
    return None


def limit_ratio(ctx: Context, row: Row) -> Optional[float]:
    """``row`` against the best copy kernel of the same runs (see the module docstring)."""
    best = max((r.gbps for r in ctx.rows if r.system in _LIMITS and r.workload == row.workload
                and r.case == row.case and r.op == row.op), default=0.0)
    return row.gbps / best if best > 0 else None


def _lat(ctx: Context, system: str, op: str) -> Optional[Latency]:
    return next((x for x in ctx.latency if x.system == system and x.op == op), None)


def targets(ctx: Context) -> list[dict[str, Any]]:
    """The issue's targets, each measured (``met`` is None when not measured)."""
    out: list[dict[str, Any]] = []
    ran = {r.system for r in ctx.rows} | {x.system for x in ctx.latency}

    def add(target: str, system: str, measured: Optional[float], goal: float,
            higher: bool = True, unit: str = "x limit", detail: str = "") -> None:
        if system not in ran:
            return
        met = None if measured is None else (measured >= goal if higher else measured <= goal)
        out.append({"target": target, "system": system, "measured": measured,
                    "goal": goal, "unit": unit, "met": met, "detail": detail})

    for system in ("ems-embedded", "ems-daemon"):
        for op in ("save", "load"):
            big = [r for r in ctx.rows if r.workload == "v0" and r.system == system
                   and r.op == op and (r.value_bytes or 0) >= 1 << 20]
            worst = min(big, key=lambda r: limit_ratio(ctx, r) or 0.0, default=None)
            add(f"V0 {op}, values >= 1 MiB, >= 0.9x limit (worst case)", system,
                limit_ratio(ctx, worst) if worst else None, 0.9,
                detail=worst.case if worst else "")
            vs = []
            for r in big:
                mc = next((m for m in ctx.rows if m.system == "mooncake" and m.op == op
                           and m.workload == "v0" and m.case == r.case), None)
                if mc is not None and mc.gbps > 0:
                    vs.append((r.gbps / mc.gbps, r.case))
            w = min(vs, default=None)
            add(f"V0 {op}, values >= 1 MiB, >= Mooncake same-host (worst case)", system,
                w[0] if w else None, 1.0, unit="x mooncake", detail=w[1] if w else "")
        for op in ("save", "load"):
            v1 = [r for r in ctx.rows if r.workload == "v1" and r.system == system
                  and r.op == op]
            worst = min(v1, key=lambda r: limit_ratio(ctx, r) or 0.0, default=None)
            add(f"V1 (block 16 and 128) {op} >= 0.9x limit (worst case)", system,
                limit_ratio(ctx, worst) if worst else None, 0.9,
                detail=worst.case if worst else "")
    _cross_host_targets(ctx, add)
    for system, goal in (("ems-daemon", 40.0), ("ems-embedded", 15.0)):
        for op in ("save", "load"):
            lat = _lat(ctx, system, op)
            add(f"1-key 4 KiB {op} round trip p50 <= {goal:.0f} us", system,
                lat.pct(50) if lat else None, goal, higher=False, unit="us")
    procs = max((int(r.case.split()[0]) for r in ctx.rows if r.workload == "scaling"),
                default=0)
    for op in ("save", "load"):
        found = next((r for r in ctx.rows if r.workload == "scaling"
                      and r.system == "ems-daemon" and r.op == op
                      and r.case.startswith(f"{procs} proc")), None)
        add(f"{procs or 4} processes together, {op} >= 0.8x memcpy ({procs or 4} processes)",
            "ems-daemon", ratio(ctx, found) if found else None, 0.8, unit="x memcpy")
    return out


def _cross_host_targets(ctx: Context, add: Any) -> None:
    """Issue 11's cross-host targets for ``ems-cluster`` (V0, values >= 1 MiB, worst
    case): >= 0.4x limit, >= 3x valkey-py, >= Mooncake over TCP (both layouts,
    ``mooncake-tcp`` and ``mooncake-tcp-node``: ``ems.bench.mooncake_tcp``)."""
    for op in ("save", "load"):
        big = [r for r in ctx.rows if r.workload == "v0" and r.system == "ems-cluster"
               and r.op == op and (r.value_bytes or 0) >= 1 << 20]
        worst = min(big, key=lambda r: limit_ratio(ctx, r) or 0.0, default=None)
        add(f"cross-host V0 {op}, values >= 1 MiB, >= 0.4x limit (worst case)",
            "ems-cluster", limit_ratio(ctx, worst) if worst else None, 0.4,
            detail=worst.case if worst else "")
        for peer, goal in (("valkey-py", 3.0), ("mooncake-tcp", 1.0),
                           ("mooncake-tcp-node", 1.0)):
            vs = []
            for r in big:
                m = next((m for m in ctx.rows if m.system == peer and m.op == op
                          and m.workload == "v0" and m.case == r.case), None)
                if m is not None and m.gbps > 0:
                    vs.append((r.gbps / m.gbps, r.case))
            w = min(vs, default=None)
            add(f"cross-host V0 {op}, values >= 1 MiB, >= {goal:g}x {peer} (worst case)",
                "ems-cluster", w[0] if w else None, goal, unit=f"x {peer}",
                detail=w[1] if w else "")


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def table(ctx: Context) -> str:
    """A Markdown table of every throughput row, then latency, problems and targets."""
    lines = ["| workload | case | system | op | GB/s | x limit | x memcpy | best GB/s | note |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in ctx.rows:
        lines.append(f"| {r.workload} | {r.case} | {r.system} | {r.op} | {r.gbps:.2f} | "
                     f"{_fmt(limit_ratio(ctx, r))} | {_fmt(ratio(ctx, r))} | "
                     f"{r.gbps_best:.2f} | {r.note} |")
    if ctx.latency:
        lines += ["", "| latency (4 KiB, 1 key) | op | p50 us | p90 us | p99 us | n |",
                  "|---|---|---:|---:|---:|---:|"]
        for lat in ctx.latency:
            lines.append(f"| {lat.system} | {lat.op} | {lat.pct(50):.1f} | "
                         f"{lat.pct(90):.1f} | {lat.pct(99):.1f} | {len(lat.us)} |")
    if ctx.problems:
        lines += ["", "Not measured (with the reason):"]
        lines += [f"- {p['system']} / {p['workload']}: {p['reason']}" for p in ctx.problems]
    tg = targets(ctx)
    if tg:
        lines += ["", "| target | system | measured | met |", "|---|---|---:|---|"]
        for t in tg:
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            detail = f" ({t['detail']})" if t["detail"] else ""
            lines.append(f"| {t['target']} | {t['system']} | "
                         f"{_fmt(t['measured'])} {t['unit']}{detail} | {met} |")
    return "\n".join(lines)


def commit(since: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The git commit of the ems checkout (where it is one) and the package version.

    ``since``: this function's answer when the run began, which is what a run records
    (the code it imported then), marked ``dirty`` when the checkout is another commit
    now or was dirty then: a process the run started meanwhile imported other code.
    (Taken at the end alone, a run during which a commit landed named that commit,
    clean, for code it never ran.)"""
    now = _commit()
    if since is None:
        return now
    if since.get("commit") != now.get("commit") or now.get("dirty"):
        return {**since, "dirty": True}
    return since


def _commit() -> dict[str, Any]:
    import ems
    here = os.path.dirname(os.path.abspath(ems.__file__))
    out: dict[str, Any] = {"version": getattr(ems, "__version__", "?")}
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if sha.returncode == 0:
            out["commit"] = sha.stdout.strip()
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain",
                                    "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5)
            out["dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(), "machine": platform.machine(),
        "python": platform.python_version(), "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                                if ln.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            kb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
            info["memory_gib"] = round(kb / (1 << 20), 1)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    for dist in ("mooncake-transfer-engine-non-cuda", "redis", "hiredis"):
        try:
            from importlib.metadata import version
            info[dist] = version(dist)
        except Exception:  # noqa: BLE001 - not installed
            pass
    return info


def to_json(ctx: Context, args: dict[str, Any], peers: dict[str, Any],
            started: datetime.datetime, elapsed_s: float,
            ems_at_start: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    def row(r: Row) -> dict[str, Any]:
        return {"workload": r.workload, "case": r.case, "system": r.system, "op": r.op,
                "bytes": r.bytes, "value_bytes": r.value_bytes, "gbps": r.gbps,
                "gbps_best": r.gbps_best, "ratio_to_memcpy": ratio(ctx, r),
                "ratio_to_limit": limit_ratio(ctx, r),
                "seconds": r.seconds, "note": r.note}

    def lat(x: Latency) -> dict[str, Any]:
        qs = np.linspace(0, 100, 101)
        return {"system": x.system, "op": x.op, "value_bytes": x.value_bytes,
                "n": len(x.us), "p50_us": x.pct(50), "p90_us": x.pct(90),
                "p99_us": x.pct(99), "mean_us": float(np.mean(x.us)) if x.us else None,
                "cdf_us": [float(v) for v in np.percentile(x.us, qs)] if x.us else []}

    return {
        "schema": 1,
        "date": started.isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed_s, 1),
        "machine": machine(),
        "ems": commit(since=ems_at_start),
        "args": args,
        "peers": peers,
        "results": [row(r) for r in ctx.rows],
        "latency": [lat(x) for x in ctx.latency],
        "fill_series": {k: v for k, v in ctx.fill_series.items()},
        "problems": ctx.problems,
        "targets": targets(ctx),
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")


def guarded_run(work_dir: Optional[str], argv: Sequence[str],
                body: Callable[[], dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Run one ``ems bench`` mode's ``body`` with the signal handlers that stop every
    process it starts, then stop them and remove ``work_dir`` (if any) whatever
    happened.

    Returns the run's JSON: the header every mode shares (``schema``, ``date``,
    ``elapsed_s``, ``machine``, ``loadavg`` at start and end -- other processes' CPU
    demand, which the figures depend on --, ``ems``, ``argv``) and ``body``'s results;
    None when interrupted (said on stderr; the caller exits 130)."""
    from ems.bench import procs
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    ems_at_start = commit()
    restore = procs.install_signal_handlers()
    try:
        results = body()
    except KeyboardInterrupt:
        print("ems bench: interrupted; every process it started was stopped",
              file=sys.stderr)
        return None
    finally:
        procs.stop_all()
        restore()
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)
    return {"schema": 1, "date": started.isoformat(timespec="seconds"),
            "elapsed_s": round(time.monotonic() - t0, 1), "machine": machine(),
            "loadavg": {"start": load0, "end": os.getloadavg()[0]},
            "ems": commit(since=ems_at_start), "argv": list(argv), **results}
