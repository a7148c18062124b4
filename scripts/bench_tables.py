"""Writes the tables of docs/benchmarks.md from the committed JSON of the latest runs.

    python scripts/bench_tables.py           # rewrite the generated blocks in place
    python scripts/bench_tables.py --check   # exit 1 if a block differs (scripts/test.sh)

Each table sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->`` in the
page; everything else on the page is written by hand. The sources: ``docs/bench.json``
(``ems bench --out DIR`` writes ``DIR/bench.json``), ``docs/vllm_ttft.json``
(``benchmarks/vllm_ttft.py``), ``docs/control-propagation.json``
(``benchmarks/control_propagation.py``), ``docs/bench-disk.json`` (``ems bench --disk
--out DIR`` writes ``DIR/bench-disk.json``), ``docs/disk_load_breakdown.json``
(``benchmarks/disk_load_breakdown.py``), ``docs/disk_spill_breakdown.json``
(``benchmarks/disk_spill_breakdown.py``), ``docs/disk_backpressure.json``
(``benchmarks/disk_backpressure.py``), ``docs/vllm_ttft_hybrid.json``
(``benchmarks/vllm_ttft.py --arch gemma3``), ``docs/kv_events.json``
(``benchmarks/kv_events_rate.py``), ``docs/netns.json`` (``benchmarks/netns_bench.py``),
``docs/sglang_ttft.json`` (``benchmarks/sglang_ttft.py``) and ``docs/bench-trace.json`` /
``docs/bench-trace-2mib.json`` (``ems bench --trace FILE ... --json PATH``; their tables
are drawn by ``ems.bench.trace``, the same functions that print them); ``docs/bench-gpu.json``
(``benchmarks/gpu_check.py --json``) where a GPU run was made: until then its block
says so. A new run replaces the JSON; this script then replaces the tables, so the
page never shows a figure that no JSON holds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGE = DOCS / "benchmarks.md"

#: the columns of the throughput table: (system in the JSON, heading)
SYSTEMS = [
    ("copy-nt", "limit: copy-nt"), ("copy-glibc", "copy-glibc"), ("memcpy", "numpy memcpy"),
    ("ems-embedded", "ems embedded"), ("ems-daemon", "ems daemon"), ("mooncake", "Mooncake"),
    ("redis", "Redis"), ("ems-cluster", "ems cluster (cross-host)"),
    ("valkey-py", "valkey-py (cross-host)"), ("mooncake-tcp", "Mooncake TCP (cross-host)"),
    ("mooncake-tcp-node", "Mooncake TCP node (cross-host)"),
]
#: systems whose "x limit" is shown beside their GB/s (the peers' are in the JSON)
WITH_RATIO = {"copy-glibc", "memcpy", "ems-embedded", "ems-daemon", "mooncake", "ems-cluster"}


def _load(name: str) -> dict[str, Any]:
    with open(DOCS / name) as f:
        data: dict[str, Any] = json.load(f)
    return data


def _num(x: Optional[float], spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _cell(row: Optional[dict[str, Any]]) -> str:
    if row is None:
        return "–"
    out = _num(row["gbps"])
    if row["system"] in WITH_RATIO and row.get("ratio_to_limit") is not None:
        out += f" ({row['ratio_to_limit']:.2f})"
    return out


def bench_run(d: dict[str, Any]) -> str:
    m, ems = d["machine"], d["ems"]
    commit = _commit(ems)
    p = d["args"]["params"]
    return (f"Run of {d['date'][:10]}, ems {ems.get('version', '?')} at commit {commit}, "
            f"`ems bench {' '.join('DIR' if a.startswith('/') else a for a in d['args']['argv'])}` "
            f"({'quick' if d['args']['quick'] else 'full'}, {p['reps']} repetitions, "
            f"{d['elapsed_s']:.0f} s): {m.get('cpus')} × {m.get('cpu', '?')} vCPU, "
            f"{m.get('memory_gib', '?')} GiB, {m['platform'].split('-with')[0]}, "
            f"Python {m['python']}, torch {m.get('torch', '–')}.")


def bench_throughput(d: dict[str, Any]) -> str:
    rows = [r for r in d["results"] if r["workload"] in ("v0", "v1")]
    cases: list[tuple[str, str]] = []
    for r in rows:
        if (r["workload"], r["case"]) not in cases:
            cases.append((r["workload"], r["case"]))
    ran = [(s, h) for s, h in SYSTEMS if any(r["system"] == s for r in rows)]
    out = ["| workload | " + " | ".join(h for _, h in ran) + " |",
           "|---|" + "---:|" * len(ran)]
    for wl, case in cases:
        cells = []
        for system, _ in ran:
            pair = [next((r for r in rows if (r["workload"], r["case"], r["system"], r["op"])
                          == (wl, case, system, op)), None) for op in ("save", "load")]
            cells.append("–" if pair == [None, None] else " / ".join(_cell(r) for r in pair))
        out.append(f"| {wl.upper()} {case} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def bench_latency(d: dict[str, Any]) -> str:
    out = ["| system | save p50 / p99 µs | load p50 / p99 µs |", "|---|---:|---:|"]
    systems: list[str] = []
    for x in d["latency"]:
        if x["system"] not in systems:
            systems.append(x["system"])
    for s in systems:
        cells = []
        for op in ("save", "load"):
            x = next((y for y in d["latency"] if (y["system"], y["op"]) == (s, op)), None)
            cells.append("–" if x is None else f"{x['p50_us']:.1f} / {x['p99_us']:.0f}")
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def bench_scaling(d: dict[str, Any]) -> str:
    rows = [r for r in d["results"] if r["workload"] in ("scaling", "fill")]
    out = ["| workload | system | save GB/s (x memcpy) | load GB/s (x memcpy) |",
           "|---|---|---:|---:|"]
    seen: list[tuple[str, str, str]] = []
    for r in rows:
        key = (r["workload"], r["case"], r["system"])
        if key in seen or r["system"] == "memcpy":
            continue
        seen.append(key)
        cells = []
        for op in ("save", "load"):
            x = next((y for y in rows if (y["workload"], y["case"], y["system"], y["op"])
                      == (*key, op)), None)
            cells.append("–" if x is None else
                         f"{x['gbps']:.2f} ({_num(x.get('ratio_to_memcpy'))})")
        out.append(f"| {r['workload']} {r['case']} | {r['system']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def bench_targets(d: dict[str, Any]) -> str:
    out = ["| target | system | measured | met |", "|---|---|---:|---|"]
    for t in d["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        detail = f" ({t['detail']})" if t.get("detail") else ""
        out.append(f"| {t['target']} | {t['system']} | {_num(t['measured'])} {t['unit']}"
                   f"{detail} | {met} |")
    for p in d.get("problems", []):
        out.append(f"| not run: {p['system']} ({p['workload']}) | – | {p['reason']} | – |")
    return "\n".join(out)


def vllm_ttft(d: dict[str, Any]) -> str:
    names = {"off": "off (no connector, cold)",
             "off2": "off2 (the same, a second process: the noise floor)",
             "miss": "miss (connector on, cold: lookup + save)",
             "hit": f"hit (connector on, {d['hit_tokens_median']:.0f} of "
                    f"{d['prompt_tokens']} tokens from ems)"}
    out = [f"| case | TTFT median | best of {d['rounds']} |", "|---|---:|---:|"]
    for k, label in names.items():
        out.append(f"| {label} | {d['ttft_median_s'][k] * 1e3:.0f} ms | "
                   f"{d['ttft_min_s'][k] * 1e3:.0f} ms |")
    c = d["connector_ms_per_request"]
    out += ["", f"Hit: TTFT **{d['speedup_hit_vs_off']:.1f}x** lower than a cold prefill "
            f"(hit rate {d['hit_rate']:.1%}; the load took {c['load_ms_hit']:.1f} ms). "
            f"Miss overhead, connector on vs off: median of the per-round ratios "
            f"{d['miss_overhead_median']:+.1%}, against the control off2 vs off "
            f"{d['control_off2_vs_off_median']:+.1%}. Inside the engine the connector's "
            f"hooks took {c['hooks_ms']:.1f} ms per request ({c['hooks_share_of_off_ttft']:.2%} "
            f"of the cold TTFT; the lookup {c['lookup_ms']:.1f} ms of it); the save, "
            f"{c['save_ms_beside']:.1f} ms, runs on its own thread beside the engine."]
    return "\n".join(out)


def control_propagation(d: dict[str, Any]) -> str:
    out = [f"Two daemons, poll period {d['poll_s']} s, {d['rounds']} rounds, "
           f"{d['cpus']} CPUs; seconds from the REST answer until both daemons showed "
           "the change:", "", "| event | p50 | max |", "|---|---:|---:|"]
    for name, e in d["events"].items():
        out.append(f"| {name} | {e['p50_s']:.3f} | {e['max_s']:.3f} |")
    return "\n".join(out)


def disk_run(d: dict[str, Any]) -> str:
    m, ems = d["machine"], d["ems"]
    commit = _commit(ems)
    argv = " ".join("DIR" if a.startswith("/") else a for a in d["argv"])
    pages = ("the daemon's shared memory and the limits' buffers in huge pages "
             "(`--huge-pages`)" if d.get("huge_pages") else
             "the daemon's shared memory and the limits' buffers in 4 KiB pages")
    return (f"Run of {d['date'][:10]}, ems {ems.get('version', '?')} at commit {commit}, "
            f"`ems bench {argv}` ({d['elapsed_s']:.0f} s): {d['mib']} MiB per value size "
            f"through {d['shm_bytes'] >> 20} MiB of shared memory, {pages}, "
            f"{d['threads']} I/O threads (the limit's depth); {m.get('cpus')} × "
            f"{m.get('cpu', '?')} vCPU, "
            f"{m.get('memory_gib', '?')} GiB, {m['platform'].split('-with')[0]}, load "
            f"average {d['loadavg']['start']:.1f} at the start, {d['loadavg']['end']:.1f} at "
            "the end (other processes on the machine).")


def disk_throughput(d: dict[str, Any]) -> str:
    out = ["| values | device write | spill | records/s | heads | load evicted | "
           "load after restart | same batches from shared memory | engine alone w / r |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def load(s: dict[str, Any], phase: str) -> str:
        gbps, ratio = s[f"load_{phase}_gbps"], s[f"load_{phase}_ratio"]
        if gbps is None or ratio is None:
            return "–"
        return f"{gbps:.2f} of {s[f'limit_read_{phase}_gbps']:.2f} ({ratio:.2f})"
    for s in d["sizes"]:
        st = s["store"]
        rec = s.get("spill_records_per_s")
        head = s.get("header_overhead")
        out.append(f"| {s['name']} | {s['limit_write_gbps']:.2f} | {s['spill_gbps']:.2f} "
                   f"({s['spill_ratio']:.2f}) | {'–' if rec is None else f'{rec:,.0f}'} | "
                   f"{'–' if head is None else f'{100 * head:.2f} %'} | "
                   f"{load(s, 'evicted')} | {load(s, 'restart')} | "
                   f"{s['load_shm_gbps']:.2f} | {st['write_gbps']:.2f} / "
                   f"{st['read_gbps']:.2f} |")
    out += ["", "GB/s (ratio to the device's limit of the same direction: the write limit "
            "is the best of writes of the value size and of the tier's write buffer size "
            "to one fresh file and of write buffers appended to region-size files, taken "
            "right before and right after the run; a load's read limit is the reads of the "
            "tier's own region files, batch by batch beside it (\"of\" that GB/s); the "
            f"median of {d['reps']} runs, each against its own limits); heads: bytes "
            "written beyond the values (batch heads, padding) per byte written. Per value "
            "size: "
            + "; ".join(
                f"{s['name']}: {s['load_restart_found']} of {s['count']} objects found "
                f"after the restart ({s['records_recovered']} records recovered, scan "
                f"{'skipped' if s['scan_skipped'] else 'run'}), {s['save_waits']} saves "
                f"waited for the writer, {s['unwritten']} objects left shared memory "
                f"unwritten, CPU per record spilled: daemon "
                f"{s['spill_daemon_cpu_us_per_record']:.1f} us, client "
                f"{s['spill_client_cpu_us_per_record']:.1f} us, disk read p50 / p99 "
                f"{s['read_latency_p50_ms']:.1f} / {s['read_latency_p99_ms']:.1f} ms, CPU "
                f"per GB loaded: daemon "
                f"{s['load_restart_daemon_cpu_s_per_gb']:.2f} s, client "
                f"{s['load_restart_client_cpu_s_per_gb']:.2f} s"
                for s in d["sizes"]) + "."]
    return "\n".join(out)


def _scans(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The scan runs of a disk bench (one record a save; saves of 64 where the run
    has them)."""
    return [d[k] for k in ("scan", "scan_batched") if k in d]


def disk_recovery(d: dict[str, Any]) -> str:
    ck = d["checkpoint"]
    return "\n".join([
        "| recovery | records | seconds | s per million (CPU) |", "|---|---:|---:|---:|",
        f"| checkpoint load (clean restart) | {ck['records']} | {ck['load_s']:.2f} | "
        f"{ck['load_s_per_million']:.2f} ({ck['load_cpu_s_per_million']:.2f}) |",
        f"| writing that checkpoint (encode) | {ck['records']} | – | "
        f"{ck['encode_s_per_million']:.2f} |"] + [
        f"| scan (no checkpoint: a crash before the first), 4 KiB records, "
        f"{sc.get('records_per_save', 1)} a save"
        + (f" ({sc['writers']} writers, {sc['records_per_batch']:.1f} records a batch)"
           if "records_per_batch" in sc else "")
        + (f", {100 * sc['resident_share']:.0f} % of its files in the page cache"
           if "resident_share" in sc else "") + f" | {sc['records']} | "
        f"{sc['scan_s']:.2f} | {sc['scan_s_per_million']:.1f} "
        f"({sc['scan_cpu_s_per_million']:.1f}) |" for sc in _scans(d)])


def disk_targets(d: dict[str, Any]) -> str:
    out = ["| target | values | measured | met |", "|---|---|---:|---|"]
    for s in d["sizes"]:
        r = s["spill_ratio"]
        out.append(f"| spill ≥ 0.9× the device's write | {s['name']} | {r:.2f}× | "
                   f"{'yes' if r >= 0.9 else '**no**'} |")
        head = s.get("header_overhead")
        if head is not None and s["size"] == 16 << 10:
            out.append(f"| header overhead ≤ 1 % of bytes written | {s['name']} | "
                       f"{100 * head:.2f} % | {'yes' if head <= 0.01 else '**no**'} |")
    for s in d["sizes"]:
        if s["size"] < 256 << 10:  # the target is for 256 KiB and 1 MiB values
            continue
        for what, key in (("evicted objects", "load_evicted_ratio"),
                          ("after a restart", "load_restart_ratio")):
            r = s.get(key)
            if r is None:
                continue
            out.append(f"| load from disk ≥ 0.8× the device's read ({what}) | {s['name']} | "
                       f"{r:.2f}× | {'yes' if r >= 0.8 else '**no**'} |")
    ck = d["checkpoint"]["load_s_per_million"]
    out.append(f"| recovery ≤ 5 s per million objects (checkpoint) | – | {ck:.2f} s | "
               f"{'yes' if ck <= 5 else '**no**'} |")
    for sc in _scans(d):
        s = sc["scan_s_per_million"]
        out.append(f"| recovery ≤ 5 s per million objects (scan, "
                   f"{sc.get('records_per_save', 1)} a save) | 4 KiB | {s:.1f} s | "
                   f"{'yes' if s <= 5 else '**no**'} |")
    return "\n".join(out)




def _breakdown_run(d: dict[str, Any], script: str, what: str) -> str:
    """The line above a breakdown's table: its run, and ``what`` it measured (in it,
    ``{shm}`` is the shared memory and ``{pages}`` its pages)."""
    pages = "huge pages" if d["huge_pages"] else "4 KiB pages"
    shm = f"{d['shm_mib']} MiB of shared memory"
    return (f"Run of {d['date'][:10]} at commit {_commit(d['ems'])}, `python "
            f"benchmarks/{script}.py {' '.join(d['argv'])}`: {d['mib']} MiB per value "
            f"size {what.format(shm=shm, pages=pages)}; load average "
            f"{d['loadavg']['start']:.1f} / {d['loadavg']['end']:.1f} (start / end).")


def disk_load_breakdown(d: dict[str, Any]) -> str:
    out = [_breakdown_run(d, "disk_load_breakdown", "through {shm} ({pages}, and so "
                          "are the device reads' buffers), every object loaded back "
                          "from the disk after a restart"), "",
           "| values | a load | its parts | first part | wait for a later part | "
           "copy of a part | copies hidden behind a read | after the last answer | load | "
           "device read beside it |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        parts = (" + ".join(str(n >> 20) for n in r["parts"]) + " MiB"
                 if not any(n % (1 << 20) for n in r["parts"])
                 else " + ".join(_size(n) for n in r["parts"]))
        out.append(f"| {r['name']} | {_size(r['load_bytes'])} | "
                   f"{parts}, up to {r['window']} × {_size(r['part_bytes'])} in flight | "
                   f"{r['first_part_ms']:.1f} ms | "
                   f"{r['wait_ms']:.1f} ms | {r['copy_ms']:.1f} ms | "
                   f"{100 * r['hidden_copies']:.0f} % | {r['after_last_ms']:.1f} ms | "
                   f"{r['load_gbps']:.2f} GB/s | {r['device_gbps']:.2f} GB/s |")
    out += ["", "Medians over the loads and their parts. The wait is from the end of a "
            "part's copy to the next part's answer: the disk's read that the copy did not "
            "hide. A copy is hidden when the next part's answer came after it ended. After "
            "the last answer: from the last part's answer to the load's return, the "
            "copies that no read hides."]
    return "\n".join(out)


def disk_spill_breakdown(d: dict[str, Any]) -> str:
    out = [_breakdown_run(d, "disk_spill_breakdown", f"saved through {{shm}} ({{pages}}) "
                          f"by one client, on {d['cpus']} CPUs"), "",
           "| values | spill | device busy | requests in flight | reserve waits | copies | "
           "commit wait | client's own | after the saves | CPU: client / daemon loop / "
           "daemon threads |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["rows"]:
        busy = "–" if r["device_busy"] is None else f"{100 * r['device_busy']:.0f} %"
        depth = "–" if r["device_depth"] is None else f"{r['device_depth']:.1f}"
        out.append(f"| {r['name']} | {r['spill_gbps']:.2f} GB/s ({r['values_per_s']:,.0f} "
                   f"a second) | {busy} | {depth} | {r['reserve_wait_us']:.1f} µs | "
                   f"{r['copy_us']:.1f} µs | {r['commit_wait_us']:.1f} µs | "
                   f"{r['client_own_us']:.1f} µs | {r['after_saves_ms']:.0f} ms | "
                   f"{r['client_cpu_us']:.1f} / {r['daemon_loop_cpu_us']:.1f} / "
                   f"{r['daemon_threads_cpu_us']:.1f} µs |")
    out += ["", "Per value saved, the run's sums divided by its values. Reserve waits, "
            "copies, commit wait and the client's own work make up the client's save "
            "calls, one after the other; after the saves: until nothing waits or runs for "
            "the disk. Device busy: the share of the run with a request in flight; "
            "requests in flight: their average number (the block device's `io_ticks` and "
            "`time_in_queue`). The daemon's threads are its disk writers, mostly."]
    return "\n".join(out)


def disk_backpressure(d: dict[str, Any]) -> str:
    commit = _commit(d["ems"])
    out = [f"Run of {d['date'][:10]} at commit {commit}, `python "
           f"benchmarks/disk_backpressure.py {' '.join(d['argv'])}` ({d['elapsed_s']:.0f} s): "
           f"the first {d['requests']:,} requests of {d['trace']} ({d['blocks']:,} blocks, "
           f"{d['distinct']:,} distinct, of {_size(d['block_bytes'])}), one client at the "
           f"SDK's full speed, shared memory of {d['capacity_blocks']:,} blocks "
           f"({d['capacity_blocks'] * d['block_bytes'] / 2**20:.1f} MiB) in the disk runs; load "
           f"average {d['loadavg']['start']:.1f} / {d['loadavg']['end']:.1f} (start / end).",
           ""]
    from ems.bench.backpressure import backpressure_table
    return "\n".join(out) + "\n" + backpressure_table(d)


def trace_run(d: dict[str, Any]) -> str:
    m, ems = d["machine"], d["ems"]
    commit = _commit(ems)
    argv = " ".join(a.rsplit("/", 1)[-1] if a.startswith("/") else a for a in d["argv"])
    traces = ", ".join(f"{t['name']} ({t['requests']:,} requests, {t['blocks']:,} blocks, "
                       f"{t['distinct']:,} distinct)" for t in d["traces"])
    return (f"Run of {d['date'][:10]}, ems {ems.get('version', '?')} at commit {commit}, "
            f"`ems bench {argv}` ({d['elapsed_s']:.0f} s): {traces}; "
            f"{m.get('cpus')} × {m.get('cpu', '?')} vCPU, {m.get('memory_gib', '?')} GiB, "
            f"load average {d['loadavg']['start']:.1f} at the start, "
            f"{d['loadavg']['end']:.1f} at the end (other processes on the machine).")


def trace_hits(d: dict[str, Any]) -> str:
    from ems.bench.trace import hits_table
    return hits_table(d)


def trace_speed(d: dict[str, Any]) -> str:
    from ems.bench.trace import speed_table
    return speed_table(d)


def kv_events(d: dict[str, Any]) -> str:
    m = d["delay_ms"]
    return "\n".join([
        f"| measure (BlockStored of {d['hashes_per_batch']} hashes) | value |", "|---|---:|",
        f"| published and decoded, flat out | {d['events_per_s']:.0f} events/s "
        f"({d['hashes_per_s']:.0f} block hashes/s), {d['dropped_batches']} dropped |",
        f"| `stored()` call, caller's thread | {d['stored_call_us']:.0f} us |",
        f"| `stored()` -> subscriber has the decoded batch, paced at "
        f"{d['paced_per_s']:.0f}/s | median {m['median']:.2f} ms, p90 {m['p90']:.1f} ms, "
        f"p99 {m['p99']:.0f} ms |"])


def netns_cross_host(d: dict[str, Any]) -> str:
    out = ["| value | save GB/s | load GB/s | ceiling GB/s | load / ceiling |",
           "|---|---:|---:|---:|---:|"]
    for r in d["cross_host"]:
        out.append(f"| {_size(r['value_bytes'])} | {r['save_gbps']:.2f} | "
                   f"{r['load_gbps']:.2f} | {r['ceiling_gbps']:.2f} | "
                   f"{r['load_vs_ceiling']:.2f}x |")
    return "\n".join(out)


def netns_latency(d: dict[str, Any]) -> str:
    out = [f"| 1-key load ({_size(d['latency_value_bytes'])}, a cluster hit) | p50 | p99 | "
           "max | misses |", "|---|---:|---:|---:|---:|"]
    for path, r in d["latency"].items():
        out.append(f"| {path} | {r['p50_ms']:.2f} ms | {r['p99_ms']:.1f} ms | "
                   f"{r['max_ms']:.1f} ms | {r['misses']} |")
    out += ["", "| a GET while a SET batch goes to the same node | p50 | max |",
            "|---|---:|---:|"]
    for lanes, r in d["read_during_write"].items():
        out.append(f"| {lanes} | {r['p50_ms']:.1f} ms | {r['max_ms']:.1f} ms |")
    return "\n".join(out)


def sglang_ttft(d: dict[str, Any]) -> str:
    import statistics
    names = {"off": "HiCache, no L3", "ems-miss": "ems, miss (stores)",
             "file-miss": "`file`, miss (stores)", "ems-hit": "ems, hit",
             "file-hit": "`file`, hit"}
    regimes = d["regimes"]

    def heading(r: dict[str, Any]) -> str:
        busy = "quiet" if r["busy_cores"] == 0 else f"{r['busy_cores']} core busy"
        return (f"{busy} (load {r['loadavg_before'][0]:.1f} -> "
                f"{r['loadavg_after'][0]:.1f})")

    out = ["| engine | " + " | ".join(f"{heading(r)}: median / min" for r in regimes)
           + " | L3 hit tokens (median) | OpenMP workers |",
           "|---|" + "---:|" * len(regimes) + "---:|---:|"]
    for key, label in names.items():
        cells = [f"{r['engines'][key]['ttft_median_s']:.2f} s / "
                 f"{r['engines'][key]['ttft_min_s']:.2f} s" for r in regimes]
        hits = [h for r in regimes for h in r["engines"][key]["storage_hit_tokens"]]
        workers = sorted({o["workers"] for r in regimes for o in r["engines"][key]["openmp"]})
        out.append(f"| {label} | " + " | ".join(cells) +
                   f" | {statistics.median(hits):.0f} | {', '.join(map(str, workers))} |")
    ratios = {"ems_hit_vs_file_hit": "ems hit / `file` hit (target <= 1)",
              "ems_miss_vs_file_miss": "ems miss / `file` miss (target <= 1.1)",
              "ems_miss_vs_off": "ems miss / no L3 (target <= 1.1)"}
    for key, label in ratios.items():
        out.append(f"| {label} | " + " | ".join(f"**{r['ratios'][key]:.2f}**"
                                               for r in regimes) + " | | |")
    p = d["backend_probe"]
    checks = all(r["targets"]["every_hit_whole_prefix"] and r["targets"]["outputs_identical"]
                 for r in regimes)
    env = ", ".join(f"{k}={v}" for k, v in d["openmp_env"].items())
    out += ["", f"{d['cpus']} CPUs, {env}; {d['rounds']} rounds x {d['prompts']} prompts "
            f"per regime. Every hit took the whole prefix from L3 and outputs were "
            f"identical: {'yes' if checks else 'NO'}. The backend alone, "
            f"{p['pages']} pages of {p['page_bytes'] >> 10} KiB: `batch_get_v1` "
            f"{p['get_ms_median']:.1f} ms ({p['get_gbps']:.1f} GB/s), `batch_set_v1` "
            f"{p['set_ms_median']:.1f} ms ({p['set_gbps']:.1f} GB/s), `batch_exists` of "
            f"missing pages {p['exists_miss_ms_median']:.2f} ms."]
    return "\n".join(out)


def gpu_check(d: Optional[dict[str, Any]]) -> str:
    if d is None:
        return ("Not measured yet — no GPU lent. `benchmarks/gpu_check.py --json "
                "docs/bench-gpu.json` on a CUDA machine writes the figures this table shows.")
    from ems.bench.gpu import gpu_table
    return gpu_table(d)


def _commit(ems: dict[str, Any]) -> str:
    """A run's commit as the pages print it: 7 hex digits, "(dirty)" when it was."""
    return ems.get("commit", "?")[:7] + (" (dirty)" if ems.get("dirty") else "")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


BLOCKS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "bench-run": ("bench.json", bench_run),
    "bench-throughput": ("bench.json", bench_throughput),
    "bench-latency": ("bench.json", bench_latency),
    "bench-scaling": ("bench.json", bench_scaling),
    "bench-targets": ("bench.json", bench_targets),
    "vllm-ttft": ("vllm_ttft.json", vllm_ttft),
    "control-propagation": ("control-propagation.json", control_propagation),
    "disk-run": ("bench-disk.json", disk_run),
    "disk-throughput": ("bench-disk.json", disk_throughput),
    "disk-recovery": ("bench-disk.json", disk_recovery),
    "disk-targets": ("bench-disk.json", disk_targets),
    "disk-load-breakdown": ("disk_load_breakdown.json", disk_load_breakdown),
    "disk-spill-breakdown": ("disk_spill_breakdown.json", disk_spill_breakdown),
    "disk-backpressure": ("disk_backpressure.json", disk_backpressure),
    "vllm-ttft-hybrid": ("vllm_ttft_hybrid.json", vllm_ttft),
    "kv-events": ("kv_events.json", kv_events),
    "netns-cross-host": ("netns.json", netns_cross_host),
    "netns-latency": ("netns.json", netns_latency),
    "sglang-ttft": ("sglang_ttft.json", sglang_ttft),
    "trace-run": ("bench-trace.json", trace_run),
    "trace-hits": ("bench-trace.json", trace_hits),
    "trace-speed": ("bench-trace.json", trace_speed),
    "trace-2mib-run": ("bench-trace-2mib.json", trace_run),
    "trace-2mib-hits": ("bench-trace-2mib.json", trace_hits),
    "trace-2mib-speed": ("bench-trace-2mib.json", trace_speed),
}
#: blocks whose JSON may be absent (no run yet): rendered from None
OPTIONAL: dict[str, tuple[str, Callable[[Optional[dict[str, Any]]], str]]] = {
    "gpu-check": ("bench-gpu.json", gpu_check),
}


def render(page: str) -> str:
    for name, (source, make) in BLOCKS.items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end: {name} -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"{PAGE}: no block '{name}' (<!-- generated: {name} -->)")
        body = make(_load(source))
        page = pattern.sub(lambda m, b=body: f"{m.group(1)}{b}\n{m.group(2)}", page)
    for name, (source, maybe) in OPTIONAL.items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end: {name} -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"{PAGE}: no block '{name}' (<!-- generated: {name} -->)")
        body = maybe(_load(source) if (DOCS / source).exists() else None)
        page = pattern.sub(lambda m, b=body: f"{m.group(1)}{b}\n{m.group(2)}", page)
    return page


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if the page's tables differ from the JSON")
    args = ap.parse_args(argv)
    old = PAGE.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{PAGE.name}: the generated tables differ from the JSON; "
                  "run python scripts/bench_tables.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        PAGE.write_text(new)
        print(f"rewrote the tables of {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
