"""``ems bench --trace FILE``: a request trace replayed through ems as a prefix-caching
engine uses the cache, beside the hit rates of exact LRU, the offline optimum and the
infinite bound of the same capacity (:mod:`ems.bench.trace_sim`).

Usage::

    ems bench --trace conversation_trace.jsonl.xz --capacities 1000,10000,30000 \\
              --block-bytes 16384 --json out/bench-trace.json

Per capacity (in blocks of ``--block-bytes``), each system starts empty with exactly
``capacity x block_bytes`` bytes: the embedded pool (``embedded``), an ``ems-server``
the bench starts on a unix socket in a temp dir (``daemon``), and ``ems-server --disk
DIR`` (``disk``: shared memory of the same size, a disk tier that holds every distinct
block of the trace). Each is stopped by PID at the end, on an error and on Ctrl-C.

One client replays the requests in order, closed loop (no arrival times), per request:

1. ``exists`` of the chain's block keys: how many leading blocks the pool holds;
2. ``load`` of those leading blocks into zeroed buffers; every byte of every loaded
   block is compared with the value saved for its id (:class:`BlockValues`: derived
   from the id, so the check is exact); differing bytes are ``wrong_bytes`` (must be 0);
3. ``save`` of the rest of the chain, as an engine does after prefill (a block already
   stored counts as saved without a copy).

The hit rate is the leading blocks loaded / blocks asked. Keys are V0 keys, one per
block, each value one buffer of ``block_bytes``: what SGLang's HiCache backend
(:mod:`ems.integrations.sglang`) does, one key and one pool object per page, straight
from the engine's host memory. V1 (``slot_mapping`` + ``hashes``) stores the same one
object per block hash through a registered layout; it would need torch and a KV layout
for bytes the bench wants to write directly, for the same pool traffic.

Timed per request: the three SDK calls (not the bench's own zeroing, value generation
and checks, which stand for the engine's prefill); ``lookup`` is exists + load.
``requests_per_s`` is requests / the sum of those times. After the replay, with the
pool full, the **probe** alternates, in one loop, a 1-key load of 4 KiB (the ``ems
bench`` latency row) and the lookup (exists + load) of a request of
:data:`PROBE_BLOCKS` stored blocks: the ratio of their p50s is measured in the same
run, on the same client.

Pool fill at the end: live objects' bytes / capacity, from the pool's statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from ems import KvBufferWrapper
from ems.bench.report import guarded_run, write_json
from ems.bench.systems import EmsSystem, Unavailable, ems_pool, touched
from ems.bench.trace_sim import Trace, belady, infinite, load_trace, lru
from ems.errors import EmsException

__all__ = ["BlockValues", "PROBE_BLOCKS", "SYSTEMS", "add_arguments", "main", "replay"]

KiB, MiB = 1 << 10, 1 << 20
#: the replay's systems: name in the JSON by --trace-systems word
SYSTEMS = {"embedded": "ems-embedded", "daemon": "ems-daemon", "disk": "ems-daemon-disk"}
#: blocks of the probe's lookup (the conversation trace's mean chain: 288,500 / 12,031)
PROBE_BLOCKS = 24
PROBE_ROUNDS = 300
PROBE_WARM = 30
ONE_KEY_BYTES = 4 * KiB


class BlockValues:
    """The value of block ``h``: a fixed random template of ``block_bytes`` (as uint64
    words) plus ``(h + 1) * φ64`` in every word, so every byte depends on the id and
    a block loaded under another id, or half-written, differs in most of its bytes.
    Filling or checking a block is one numpy pass over it (~0.1 ms per MiB here)."""

    def __init__(self, block_bytes: int) -> None:
        if block_bytes < 8 or block_bytes % 8:
            raise SystemExit(f"ems bench: --block-bytes must be a multiple of 8, "
                             f"got {block_bytes}")
        self.block_bytes = block_bytes
        self.template = np.random.default_rng(26).integers(
            0, 1 << 63, block_bytes // 8, dtype=np.uint64)

    @staticmethod
    def _words(ids: Sequence[int]) -> np.ndarray:
        return (np.asarray(ids, dtype=np.uint64) + np.uint64(1)) * np.uint64(
            0x9E3779B97F4A7C15)

    def fill(self, ids: Sequence[int], out: np.ndarray) -> None:
        """Rows of ``out`` (``[len(ids), block_bytes]`` uint8) := the ids' values."""
        if ids:
            np.add(self.template[None, :], self._words(ids)[:, None],
                   out=out.view(np.uint64))

    def wrong_bytes(self, ids: Sequence[int], got: np.ndarray) -> int:
        """How many bytes of the rows of ``got`` differ from the ids' values."""
        if not ids:
            return 0
        want = np.empty_like(got)
        self.fill(ids, want)
        if np.array_equal(want, got):
            return 0
        return int(np.count_nonzero(want != got))


@dataclasses.dataclass
class Replay:
    """What one system did on one trace at one capacity."""

    system: str
    hits: int = 0  # leading blocks loaded
    blocks: int = 0  # blocks asked
    exists_hits: int = 0  # leading blocks exists counted
    short_loads: int = 0  # requests whose load found fewer blocks than exists counted
    save_refused: int = 0  # blocks a save did not store
    wrong_bytes: int = 0
    request_s: list[float] = dataclasses.field(default_factory=list)
    lookup_s: list[float] = dataclasses.field(default_factory=list)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    probe: dict[str, Any] = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0

    def to_json(self, capacity_bytes: int, block_bytes: int) -> dict[str, Any]:
        req = np.asarray(self.request_s) * 1e3
        look = np.asarray(self.lookup_s) * 1e6
        objects = int(self.stats.get("objects", 0))
        return {
            "hit_rate": self.hits / self.blocks if self.blocks else 0.0,
            "hits": self.hits, "blocks": self.blocks, "exists_hits": self.exists_hits,
            "short_loads": self.short_loads, "save_refused": self.save_refused,
            "wrong_bytes": self.wrong_bytes,
            "fill": objects * block_bytes / capacity_bytes, "stats": self.stats,
            "requests": len(self.request_s),
            "requests_per_s": len(req) / (req.sum() / 1e3) if len(req) else None,
            "request_p50_ms": float(np.percentile(req, 50)) if len(req) else None,
            "request_p99_ms": float(np.percentile(req, 99)) if len(req) else None,
            "lookup_p50_us": float(np.percentile(look, 50)) if len(look) else None,
            "lookup_p99_us": float(np.percentile(look, 99)) if len(look) else None,
            "probe": self.probe, "wall_s": round(self.wall_s, 2),
        }


def _stats(system: EmsSystem) -> dict[str, Any]:
    """The pool's counters (``PoolStatistics``, a frozen dataclass on both pools)."""
    s = dataclasses.asdict(system.cc.statistics())
    return {k: int(s[k]) for k in (
        "capacity_bytes", "used_bytes", "objects", "evictions", "leased_bytes", "reserved",
        "pinned", "refused_full") if k in s}


def replay(system: EmsSystem, trace: Trace, values: BlockValues, capacity_bytes: int,
           name: str) -> Replay:
    """The replay of the module docstring on ``system`` (empty, ``capacity_bytes``)."""
    bb = values.block_bytes
    longest = max(trace.longest, PROBE_BLOCKS)
    src = touched(longest * bb).reshape(longest, bb)
    dst = touched(longest * bb).reshape(longest, bb)
    cc, option = system.cc, system.option
    out = Replay(name)
    clock = time.perf_counter
    enabled = gc.isenabled()
    gc.disable()  # as the other workloads' timed calls (workloads._timed)
    t_start = clock()
    try:
        for r in trace.requests:
            ids = r.hash_ids
            keys = [f"t{h}" for h in ids]
            t0 = clock()
            n = cc.exists(keys, option).success
            t1 = clock()
            found = 0
            t2 = t3 = t1
            if n:
                dst[:n].fill(0)
                t2 = clock()
                found = system.load_found(keys[:n], dst[:n])
                t3 = clock()
                out.wrong_bytes += values.wrong_bytes(ids[:found], dst[:found])
            rest = ids[found:]
            values.fill(rest, src[:len(rest)])
            t4 = clock()
            if rest:
                out.save_refused += len(rest) - system.save_stored(keys[found:],
                                                                   src[:len(rest)])
            t5 = clock()
            out.blocks += len(ids)
            out.hits += found
            out.exists_hits += n
            out.short_loads += found < n
            out.lookup_s.append((t1 - t0) + (t3 - t2))
            out.request_s.append((t1 - t0) + (t3 - t2) + (t5 - t4))
    finally:
        out.wall_s = clock() - t_start
        if enabled:
            gc.enable()
    out.stats = _stats(system)
    out.probe = probe(system, values, src, dst)
    return out


def probe(system: EmsSystem, values: BlockValues, src: np.ndarray, dst: np.ndarray
          ) -> dict[str, Any]:
    """1-key 4 KiB loads and the lookups of :data:`PROBE_BLOCKS` blocks, alternated
    (module docstring): p50 / p99 of each in µs, and the ratio of the p50s. Beside
    them, in the same rounds, the parts: a 1-key exists, the lookup's exists and its
    load, and numpy's copy of the same bytes between two buffers (the copy's floor):
    where a lookup's time goes."""
    cc, option = system.cc, system.option
    # (a pool too small for the probe beside the 4 KiB key looks up half of itself)
    blocks = max(1, min(PROBE_BLOCKS, system.capacity_bytes // values.block_bytes // 2))
    ids = list(range(1 << 62, (1 << 62) + blocks))  # no trace uses these ids
    keys = [f"t{h}" for h in ids]
    values.fill(ids, src[:blocks])
    system.save(keys, src[:blocks])
    one = touched(2 * ONE_KEY_BYTES).reshape(2, ONE_KEY_BYTES)
    one[0] = 7
    system.save(["probe-1key"], one[:1])
    names = ("one_key", "one_key_exists", "exists", "load", "lookup", "copy")
    us: dict[str, list[float]] = {k: [] for k in names}
    # The buffers' wrappers are made once, as the ems bench latency row's are (an
    # engine's are views of its KV memory), so the bench times the SDK's calls only.
    one_vals, look_vals = _wrappers(one[1:]), _wrappers(dst[:blocks])
    one_keys = ["probe-1key"]
    load, exists = cc.load, cc.exists
    clock = time.perf_counter
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(PROBE_WARM + PROBE_ROUNDS):
            t0 = clock()
            got = load(option, one_keys, one_vals).success
            t1 = clock()
            exists(one_keys, option)
            t2 = clock()
            n = exists(keys, option).success
            t3 = clock()
            found = load(option, keys[:n], look_vals[:n]).success
            t4 = clock()
            np.copyto(dst[:blocks], src[:blocks])  # the same bytes by numpy: the copy floor
            t5 = clock()
            if found != blocks or got != 1:
                raise RuntimeError(f"the probe's lookup found {found} of {blocks} "
                                   f"blocks it had just stored ({got} of its 1 key)")
            if i >= PROBE_WARM:
                for k, dt in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t2,
                                         t5 - t4)):
                    us[k].append(dt * 1e6)
    finally:
        if enabled:
            gc.enable()
    dst[:blocks].fill(0)
    if system.load_found(keys, dst[:blocks]) != blocks:
        raise RuntimeError("the probe's blocks were evicted")
    wrong = values.wrong_bytes(ids, dst[:blocks])
    wrong += int(np.count_nonzero(one[1] != 7))
    p = {f"{k}_p{q}_us": float(np.percentile(v, q)) for k, v in us.items() for q in (50, 99)}
    return {"rounds": PROBE_ROUNDS, "blocks": blocks, "one_key_bytes": ONE_KEY_BYTES,
            **p, "ratio_p50": p["lookup_p50_us"] / p["one_key_p50_us"], "wrong_bytes": wrong}


def _wrappers(rows: np.ndarray) -> list[list[KvBufferWrapper]]:
    """One V0 value per row of ``rows`` (a contiguous ``[n, size]`` uint8 array)."""
    base, size = rows.ctypes.data, rows.shape[1]
    return [[KvBufferWrapper(base + i * size, size)] for i in range(rows.shape[0])]


# ----------------------------------------------------------------------- systems

def _system(kind: str, capacity_bytes: int, disk_bytes: int
            ) -> contextlib.AbstractContextManager[EmsSystem]:
    """One empty system of ``capacity_bytes`` (and its daemon, and with ``kind`` "disk"
    its disk tier of ``disk_bytes``), stopped afterwards."""
    return ems_pool("embedded" if kind == "embedded" else "daemon", capacity_bytes,
                    prefix="ems-trace-", disk_bytes=disk_bytes if kind == "disk" else None)


def _disk_bytes(trace: Trace, block_bytes: int) -> int:
    """A disk tier that holds every distinct block of the trace (records' headers and
    alignment included, with room to spare)."""
    from ems.disk.records import record_span
    return trace.distinct * record_span(block_bytes) * 2 + 256 * MiB


# ----------------------------------------------------------------------- the run

def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``--trace*`` options of ``ems bench``."""
    g = ap.add_argument_group("trace replay (--trace)")
    g.add_argument("--trace", action="append", default=None, metavar="FILE",
                   help="replay this Mooncake-format JSONL trace (.xz or not; repeatable) "
                        "and write its JSON (--json); nothing else runs")
    g.add_argument("--capacities", default="1000,10000,30000,50000,100000",
                   help="pool capacities in blocks, comma list (default "
                        "1000,10000,30000,50000,100000)")
    g.add_argument("--block-bytes", type=int, default=16 * KiB,
                   help="bytes per block (default 16384)")
    g.add_argument("--trace-systems", default="embedded,daemon,disk",
                   help="comma list of: " + ", ".join(SYSTEMS) + " (default: all)")
    g.add_argument("--trace-requests", type=int, default=None, metavar="N",
                   help="replay only the first N requests of each trace")
    g.add_argument("--json", default=None, metavar="PATH",
                   help="where to write the trace replay's JSON (default "
                        "OUT/bench-trace.json)")


def _capacities(text: str) -> list[int]:
    out = []
    for word in text.split(","):
        word = word.strip().replace("_", "")
        if not word:
            continue
        if not word.isdigit() or int(word) < 1:
            raise SystemExit(f"ems bench: --capacities takes block counts >= 1, got {word!r}")
        out.append(int(word))
    if not out:
        raise SystemExit("ems bench: --capacities is empty")
    return out


def _systems(text: str) -> list[str]:
    out = []
    for word in text.split(","):
        word = word.strip().lower()
        if word and word not in SYSTEMS:
            raise SystemExit(f"ems bench: unknown --trace-systems {word!r}; choose from "
                             f"{', '.join(SYSTEMS)}")
        if word and word not in out:
            out.append(word)
    return out


def run_trace(path: str, trace: Trace, capacities: Sequence[int], kinds: Sequence[str],
              values: BlockValues, problems: list[dict[str, str]]
              ) -> dict[str, Any]:
    """Every capacity of one trace: the simulations, then each system's replay."""
    bb = values.block_bytes
    inf = infinite(trace)
    out: dict[str, Any] = {
        "name": os.path.basename(path), "requests": len(trace.requests),
        "blocks": trace.blocks, "distinct": trace.distinct, "longest": trace.longest,
        "infinite_hit_rate": inf.hit_rate, "capacities": []}
    for cap in capacities:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"capacity_blocks": cap, "capacity_bytes": cap * bb,
                               "lru_hit_rate": lru(trace, cap).hit_rate,
                               "belady_hit_rate": belady(trace, cap).hit_rate,
                               "infinite_hit_rate": inf.hit_rate, "systems": {}}
        row["sim_s"] = round(time.perf_counter() - t0, 2)
        for kind in kinds:
            name = SYSTEMS[kind]
            try:
                with _system(kind, cap * bb, _disk_bytes(trace, bb)) as system:
                    r = replay(system, trace, values, cap * bb, name)
            except (Unavailable, EmsException, RuntimeError) as exc:
                problems.append({"trace": out["name"], "capacity_blocks": str(cap),
                                 "system": name, "reason": f"{type(exc).__name__}: {exc}"})
                print(f"  {name}: not measured: {exc}", file=sys.stderr)
                continue
            row["systems"][name] = r.to_json(cap * bb, bb)
        out["capacities"].append(row)
        print(_line(out["name"], row), flush=True)
    return out


def _line(trace: str, row: dict[str, Any]) -> str:
    parts = [f"{trace} {row['capacity_blocks']:>7} blocks: LRU {row['lru_hit_rate']:.4f} "
             f"optimum {row['belady_hit_rate']:.4f} infinite {row['infinite_hit_rate']:.4f}"]
    for name, s in row["systems"].items():
        parts.append(f"  {name}: {s['hit_rate']:.4f} fill {s['fill']:.3f} "
                     f"{s['requests_per_s']:.0f} req/s p50 {s['request_p50_ms']:.3f} ms "
                     f"lookup p50 {s['lookup_p50_us']:.0f} us, probe "
                     f"{s['probe']['lookup_p50_us']:.0f} / 1-key "
                     f"{s['probe']['one_key_p50_us']:.0f} us, wrong {s['wrong_bytes']} "
                     f"({s['wall_s']:.0f} s)")
    return "\n".join(parts)


def _short(name: str) -> str:
    """``conversation_trace.jsonl.xz`` -> ``conversation``."""
    for suffix in (".xz", ".jsonl", ".json", "_trace"):
        name = name.removesuffix(suffix)
    return name


def _names(data: dict[str, Any]) -> list[str]:
    return [n for n in SYSTEMS.values()
            if any(n in c["systems"] for t in data["traces"] for c in t["capacities"])]


def table(data: dict[str, Any]) -> str:
    """The replay's hit rates and speeds as two Markdown tables (the benchmarks page
    shows the same, generated from the JSON by ``scripts/bench_tables.py``)."""
    return hits_table(data) + "\n\n" + speed_table(data)


def hits_table(data: dict[str, Any]) -> str:
    """Per trace and capacity: the simulations' hit rates and each system's."""
    names = _names(data)
    bb = data["block_bytes"]
    size = f"{bb // MiB} MiB" if bb >= MiB else f"{bb // KiB} KiB"
    head = " | ".join(f"{n} (× LRU)" for n in names)
    lines = [f"| trace | capacity (blocks of {size}) | LRU | optimum | infinite | {head} | "
             f"fill {' / '.join(n.removeprefix('ems-') for n in names)} | wrong bytes |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(names) + "---:|---:|"]
    for t in data["traces"]:
        for c in t["capacities"]:
            cells, fills, wrong = [], [], 0
            for n in names:
                s = c["systems"].get(n)
                if s is None:
                    cells.append("–")
                    fills.append("–")
                    continue
                x = s["hit_rate"] / c["lru_hit_rate"] if c["lru_hit_rate"] else float("nan")
                cells.append(f"{s['hit_rate']:.4f} ({x:.3f})")
                fills.append(f"{s['fill']:.2f}")
                wrong += s["wrong_bytes"] + s["probe"]["wrong_bytes"]
            lines.append(f"| {_short(t['name'])} | {c['capacity_blocks']:,} | "
                         f"{c['lru_hit_rate']:.4f} | {c['belady_hit_rate']:.4f} | "
                         f"{c['infinite_hit_rate']:.4f} | {' | '.join(cells)} | "
                         f"{' / '.join(fills)} | {wrong} |")
    return "\n".join(lines)


def speed_table(data: dict[str, Any]) -> str:
    """Per trace, capacity and system: requests/s, latencies and the probe."""
    names = _names(data)
    lines = ["| trace | capacity | system | requests/s | request p50 / p99 ms | "
             "lookup p50 / p99 µs | probe µs: lookup (exists + load) | 1-key 4 KiB load | "
             "ratio | 1-key exists | copy of the bytes |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in data["traces"]:
        for c in t["capacities"]:
            for n in names:
                s = c["systems"].get(n)
                if s is None:
                    continue
                p = s["probe"]
                lines.append(
                    f"| {_short(t['name'])} | {c['capacity_blocks']:,} | {n} | "
                    f"{s['requests_per_s']:,.0f} | {s['request_p50_ms']:.3f} / "
                    f"{s['request_p99_ms']:.2f} | {s['lookup_p50_us']:.0f} / "
                    f"{s['lookup_p99_us']:.0f} | {p['lookup_p50_us']:.0f} "
                    f"({p['exists_p50_us']:.0f} + {p['load_p50_us']:.0f}) | "
                    f"{p['one_key_p50_us']:.1f} | {p['ratio_p50']:.1f}× | "
                    f"{p['one_key_exists_p50_us']:.1f} | {p['copy_p50_us']:.1f} |")
    return "\n".join(lines)


def main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``ems bench --trace``: run, print the tables, write the JSON."""
    capacities = _capacities(args.capacities)
    kinds = _systems(args.trace_systems)
    values = BlockValues(args.block_bytes)
    if args.trace_requests is not None and args.trace_requests < 1:
        raise SystemExit("ems bench: --trace-requests must be >= 1")
    traces = []
    for path in args.trace:
        try:
            traces.append((path, load_trace(path).head(args.trace_requests)))
        except EmsException as exc:
            raise SystemExit(f"ems bench: {exc}") from None
    json_path = args.json or os.path.join(args.out, "bench-trace.json")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    problems: list[dict[str, str]] = []
    results: list[dict[str, Any]] = []

    def body() -> dict[str, Any]:
        for path, trace in traces:
            results.append(run_trace(path, trace, capacities, kinds, values, problems))
        return {"block_bytes": values.block_bytes, "capacities": capacities,
                "systems": [SYSTEMS[k] for k in kinds], "probe_blocks": PROBE_BLOCKS,
                "traces": results, "problems": problems}
    data = guarded_run(None, argv, body)
    if data is None:
        return 130
    write_json(json_path, data)
    print(table(data))
    print(f"\nwrote {json_path} ({data['elapsed_s']:.0f} s)")
    wrong = sum(s["wrong_bytes"] + s["probe"]["wrong_bytes"] for t in results
                for c in t["capacities"] for s in c["systems"].values())
    return 1 if wrong or problems else 0
