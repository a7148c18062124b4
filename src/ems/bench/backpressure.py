"""The table of ``benchmarks/disk_backpressure.py``'s JSON: printed by the benchmark and
rendered on the benchmarks page by ``scripts/bench_tables.py`` (one renderer)."""

from __future__ import annotations

from typing import Any

__all__ = ["backpressure_table"]


def backpressure_table(d: dict[str, Any]) -> str:
    """Per run: hit rate, its ratio to the unbounded run, saves, what left shared memory
    unwritten and its share of the saves, the saves that waited, requests/s, wrong bytes."""
    out = ["| run | hit rate | × unbounded | saves | left unwritten: evicted / queue full "
           "| share of saves | saves that waited | requests/s | wrong bytes |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        u = r["unwritten"]
        lost = (f"{u.get('evicted_unwritten', 0):,} / {u.get('queue_full', 0):,}"
                if r["disk"] else "–")
        share = f"{100 * r['lost_share']:.2f} %" if r["disk"] else "–"
        x = f"{r['vs_unbounded']:.3f}" if "vs_unbounded" in r else "1"
        out.append(f"| {r['name']} | {r['hit_rate']:.4f} | {x} | {r['saves']:,} | {lost} | "
                   f"{share} | {r['save_waits']:,} | {r['requests_per_s']:,.0f} | "
                   f"{r['wrong_bytes']} |")
    return "\n".join(out)
