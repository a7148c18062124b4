#!/usr/bin/env python3
"""Bursts through a small shared memory onto the disk tier: what leaves shared memory
unwritten, and the hit rate against an unbounded shared memory (issue #28, item 2).

    python benchmarks/disk_backpressure.py                 # table, disk_backpressure.json
    python benchmarks/disk_backpressure.py --out docs --requests 3000 --delays 0,40

The first ``--requests`` of Mooncake's conversation trace (``--trace``) are replayed
as ``ems bench --trace`` replays them (``ems.bench.trace.replay``: exists, load of the
leading blocks with every byte checked, save of the rest; one closed-loop client at
the SDK's full speed) through:

* **unbounded**: an ``ems-server`` whose shared memory holds every distinct block of
  the run (no disk): the hit rate a bounded one is held against;
* **disk**: ``ems-server --disk`` with ``--capacity`` blocks of shared memory, for each
  ``--delays`` (``disk.io_delay_ms``: every read and write of the disk waits that long
  first, a disk slower than the saves) and each ``--waits`` (``disk.save_wait_ms``: how
  long a save that finds shared memory full of objects not on disk yet waits for the
  writer; 0: it evicts one at once).

Per run: the hit rate and its ratio to the unbounded run's, the saves (blocks the
client saved), the objects that left shared memory unwritten by reason (the disk
tier's ``unwritten`` counters) and their share of the saves, the saves that waited,
requests/s, and the wrong bytes (must be 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ems.bench.backpressure import backpressure_table
from ems.bench.report import commit
from ems.bench.systems import ems_pool
from ems.bench.trace import BlockValues, _disk_bytes, replay
from ems.bench.trace_sim import infinite, load_trace

HERE = Path(__file__).resolve().parent
TRACE = HERE.parent.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl.xz"


def _ints(text: str) -> list[float]:
    return [float(w) for w in text.split(",") if w.strip()]


def run(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_trace(str(args.trace)).head(args.requests)
    bb = args.block_bytes
    values = BlockValues(bb)
    rows: list[dict[str, Any]] = []

    def one(name: str, capacity_bytes: int, disk: bool, delay_ms: float, wait_ms: float
            ) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="ems-bp-") as tmp:
            server_args: list[str] = []
            if disk:
                cfg = os.path.join(tmp, "ems.toml")
                with open(cfg, "w") as f:
                    f.write(f"[disk]\nio_delay_ms = {delay_ms}\nsave_wait_ms = {wait_ms}\n")
                server_args = ["--config", cfg]
            with ems_pool("daemon", capacity_bytes, prefix="ems-bp-",
                          disk_bytes=_disk_bytes(trace, bb) if disk else None,
                          server_args=server_args) as system:
                r = replay(system, trace, values, capacity_bytes, name)
                report = system.daemon_report() or {}
        d = report.get("disk") or {}
        unwritten = {k: int(v) for k, v in (d.get("unwritten") or {}).items()}
        saves = r.blocks - r.hits
        lost = unwritten.get("evicted_unwritten", 0) + unwritten.get("queue_full", 0)
        req = sum(r.request_s)
        row = {"name": name, "capacity_bytes": capacity_bytes, "disk": disk,
               "io_delay_ms": delay_ms, "save_wait_ms": wait_ms, "hit_rate": r.hits / r.blocks,
               "hits": r.hits, "blocks": r.blocks, "saves": saves,
               "save_refused": r.save_refused, "unwritten": unwritten,
               "lost_share": lost / saves if saves else 0.0,
               "save_waits": int(d.get("save_waits", 0)),
               "requests_per_s": len(r.request_s) / req if req else None,
               "wrong_bytes": r.wrong_bytes, "wall_s": round(r.wall_s, 2)}
        print(f"  {name}: hit rate {row['hit_rate']:.4f}, lost {100 * row['lost_share']:.2f} %"
              f" of {saves} saves {unwritten}, {row['save_waits']} waits, "
              f"{row['requests_per_s']:.0f} requests/s", flush=True)
        return row

    distinct_bytes = trace.distinct * bb
    base = one("unbounded", distinct_bytes + (64 << 20), False, 0, 0)
    rows.append(base)
    for delay in _ints(args.delays):
        for wait in _ints(args.waits):
            row = one(f"disk, I/O +{delay:g} ms, wait {wait:g} ms", args.capacity * bb, True,
                      delay, wait)
            row["vs_unbounded"] = row["hit_rate"] / base["hit_rate"] if base["hit_rate"] else 0
            rows.append(row)
    return {"trace": args.trace.name, "requests": len(trace.requests), "blocks": trace.blocks,
            "distinct": trace.distinct, "block_bytes": bb, "capacity_blocks": args.capacity,
            "infinite_hit_rate": infinite(trace).hit_rate, "rows": rows}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake-format trace")
    ap.add_argument("--requests", type=int, default=3000, help="its first N requests")
    ap.add_argument("--capacity", type=int, default=1000,
                    help="shared memory of the disk runs, blocks (default 1000: 16 MiB)")
    ap.add_argument("--block-bytes", type=int, default=16 << 10)
    ap.add_argument("--delays", default="0,40", help="disk.io_delay_ms values, comma list "
                    "(40: 8 writers of a save each, slower than the client's saves)")
    ap.add_argument("--waits", default="0,1000",
                    help="disk.save_wait_ms values, comma list (1000: the default)")
    ap.add_argument("--out", type=Path, default=Path("."), help="where the JSON goes")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    started = time.monotonic()
    ems_at_start = commit()
    data = run(args)
    data.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), argv=["DIR" if a.startswith("/") else a for a in argv],
        ems=commit(since=ems_at_start), elapsed_s=round(time.monotonic() - started, 1),
        loadavg={"start": load0, "end": os.getloadavg()[0]})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "disk_backpressure.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(backpressure_table(data))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
