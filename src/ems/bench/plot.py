"""docs/bench.png: GB/s by value size per system (save, load), the latency CDF, and
throughput while a pool fills past its capacity. Needs matplotlib (optional)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["plot"]

_COLORS = {"memcpy": "black", "ems-embedded": "tab:blue", "ems-daemon": "tab:green",
           "mooncake": "tab:orange", "redis": "tab:red"}


def plot(data: dict[str, Any], path: str) -> Optional[str]:
    """Write the PNG; returns None, or why it was not written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (bash benchmarks/setup-peers.sh)"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    v0 = [r for r in data["results"] if r["workload"] == "v0"]
    systems = list(dict.fromkeys(r["system"] for r in v0))
    for ax, op in zip(axes[0], ("save", "load")):
        for s in systems:
            pts = sorted((r["value_bytes"], r["gbps"]) for r in v0
                         if r["system"] == s and r["op"] == op)
            if pts:
                ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o",
                        label=s, color=_COLORS.get(s), linestyle="--" if s == "memcpy"
                        else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("value size (KiB)")
        ax.set_ylabel("GB/s (median)")
        ax.set_title(f"V0 batch {op}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[1][0]
    for x in data["latency"]:
        if x["cdf_us"]:
            ax.plot(x["cdf_us"], [q / 100 for q in range(101)],
                    label=f"{x['system']} {x['op']}", color=_COLORS.get(x["system"]),
                    linestyle="-" if x["op"] == "save" else ":")
    ax.set_xscale("log")
    ax.set_xlabel("round trip (us), 1 key of 4 KiB")
    ax.set_ylabel("fraction of ops")
    ax.set_title("latency CDF (solid: save, dotted: load)")
    ax.axvline(100, color="gray", linewidth=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1][1]
    for name, pts in data.get("fill_series", {}).items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name,
                color=_COLORS.get(name))
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("bytes written / pool capacity")
    ax.set_ylabel("save GB/s (per batch)")
    ax.set_title("filling a fresh pool past capacity (evicting after 1.0)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    m, e = data.get("machine", {}), data.get("ems", {})
    fig.suptitle(f"ems bench {data.get('date', '')[:10]}, {m.get('cpus', '?')} CPUs "
                 f"({m.get('cpu', '?')}), ems {e.get('commit', e.get('version', '?'))[:10]}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
