"""The GPU check's figures as a Markdown table: what ``benchmarks/gpu_check.py`` prints
and what ``scripts/bench_tables.py`` renders from ``docs/bench-gpu.json`` on the
benchmarks page, drawn by one function so the two cannot disagree."""

from __future__ import annotations

from typing import Any

__all__ = ["gpu_table"]


def gpu_table(d: dict[str, Any]) -> str:
    """The run's header line, the throughput rows against torch's copies of the same
    bytes, and the stall line, from the JSON ``gpu_check.py --json`` writes."""
    reg = d["registration"]
    state = ("refused (pageable copies)" if reg["refusals"] else
             f"{reg['registered_bytes'] >> 20} MiB registered in {reg['seconds']:.1f} s")
    exact = ", ".join(f"{k.replace('_', ' ')} {'bit-exact' if v else '**WRONG**'}"
                      for k, v in d["exact"].items())
    m = d["machine"]
    out = [f"Run of {d['date'][:10]} on one {d['device']} (torch {m['torch']}, CUDA "
           f"{m['cuda']}, ems {m['ems']}, {d['elapsed_s']:.0f} s); pool memory: {state}; "
           f"{exact}.", "",
           "| API | run | op | ems GB/s | torch pinned | × pinned | torch pageable | "
           "× pageable | bulk pinned (link) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["throughput"]:
        out.append(f"| {r['api'].upper()} | {_size(r['run_bytes'])} | {r['op']} | "
                   f"{r['gbps']:.1f} | {r['pinned_gbps']:.1f} | {r['x_pinned']:.2f} | "
                   f"{r['pageable_gbps']:.1f} | {r['x_pageable']:.2f} | "
                   f"{r['pinned_bulk_gbps']:.1f} |")
    st = d["stall"]
    out += ["", f"A bf16 matmul loop on the engine's stream: {st['alone_ms']:.3f} ms per "
            f"iteration alone, {st['with_saves_ms']:.3f} ms with V1 saves in flight "
            f"(×{st['ratio']:.3f}; {st['blocks_saved']} blocks of 2 MiB saved meanwhile)."]
    return "\n".join(out)




def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
