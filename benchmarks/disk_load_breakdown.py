#!/usr/bin/env python3
"""Where the time of a load from disk goes through ``ems-server --disk``, part by part:
the client's copies hidden behind the disk's reads, or not.

    python benchmarks/disk_load_breakdown.py               # table, disk_load_breakdown.json
    python benchmarks/disk_load_breakdown.py --out DIR --mib 512 --shm-mib 128

The defaults (1 GiB through 256 MiB, loads of 64 MiB) are ``ems bench --disk``'s. For
each value size (1 MiB and 256 KiB, those of issue #28 item 3) a daemon takes the saves,
is restarted (SIGTERM, start: shared memory empty) and every object is loaded back from
the disk in loads of a quarter of shared memory. A load goes in parts
(``ems.client.remote.LOAD_PART_BYTES``, two in flight): this script wraps the client's
wait for a part's answer and its copy of a part (``RemoteTransport._reply``,
``V0Mover.from_pool``) with a clock, and reports per load:

* **first part**: from the call to the first part's answer (a fetch of the part from
  the disk, nothing to overlap yet);
* **wait**: per later part, from the end of the previous part's copy to its answer
  (the disk's read that the copy did not hide);
* **copy**: per part, the client's copy out of shared memory; **hidden**: the share of
  the copies made while the next part was still being read (its answer came after the
  copy ended);
* **after the last answer**: from the last part's answer to the load's return (the
  copies that no read hides: what the cut of the last part into small ones shortens);
* **load** against **device**: GB/s of the loads, and of ``O_DIRECT`` reads of as many
  bytes of the tier's own region files right after each load
  (``ems.bench.disk.RegionReads``, as ``ems bench --disk`` pairs them).

The parts are the ones the client made (counted from its copies, not recomputed), and
the daemon's shared memory and the device's reads are in huge pages where the machine
has them free (``--huge-pages``, as ``ems bench --disk-huge-pages``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from ems.bench.disk import (
    Breakdown,
    Memory,
    RegionReads,
    _key,
    _TierDaemon,
    paired_reads,
)
from ems.bench.systems import touched
from ems.client import remote
from ems.client.movers import V0Mover

MiB = 1 << 20
SIZES = (("1 MiB", 1 << 20), ("256 KiB", 256 << 10))


class Clock:
    """The client's waits for answers and its copies, while ``on``: (kind, start, end,
    values copied)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float, int]] = []
        self.on = False
        reply, from_pool = remote.RemoteTransport._reply, V0Mover.from_pool

        def timed_reply(transport: Any, flight: Any, task: Any, spin: bool = False) -> Any:
            t0 = time.perf_counter()
            got = reply(transport, flight, task, spin)
            if self.on:
                self.events.append(("answer", t0, time.perf_counter(), 0))
            return got

        def timed_copy(mover: V0Mover, items: Any, locs: Any, task: Any) -> None:
            t0 = time.perf_counter()
            from_pool(mover, items, locs, task)
            if self.on:
                self.events.append(("copy", t0, time.perf_counter(), len(items)))
        remote.RemoteTransport._reply = timed_reply  # type: ignore[method-assign]
        V0Mover.from_pool = timed_copy  # type: ignore[method-assign]
        self._undo = (reply, from_pool)

    def close(self) -> None:
        remote.RemoteTransport._reply, V0Mover.from_pool = self._undo  # type: ignore


class Timeline(NamedTuple):
    """One load, from the client's clock."""

    first: float  # s from the call to the first part's answer
    waits: list[float]  # s per later part: from the previous copy's end to its answer
    copies: list[float]  # s per part
    hidden: int  # copies that ended before the next part's answer came
    after_last: float  # s from the last part's answer to the load's return
    values: list[int]  # values per part


def _timeline(events: list[tuple[str, float, float, int]], start: float, end: float
              ) -> Timeline:
    answers = [e for e in events if e[0] == "answer"]
    copies = [e for e in events if e[0] == "copy"]
    return Timeline(
        first=answers[0][2] - start,
        waits=[max(0.0, a[2] - c[2]) for a, c in zip(answers[1:], copies)],
        copies=[c[2] - c[1] for c in copies],
        hidden=sum(1 for a, c in zip(answers[1:], copies) if a[2] > c[2]),
        after_last=end - answers[-1][2],
        values=[c[3] for c in copies])


def measure(root: Path, name: str, size: int, total: int, shm: int, clock: Clock,
            memory: Memory, say: Callable[[str], None]) -> dict[str, object]:
    count = total // size
    keys = [_key(size, i) for i in range(count)]
    per_save = max(1, (shm // 4) // size)
    src = touched(per_save * size).reshape(per_save, size)
    src[:] = np.random.default_rng(size).integers(0, 256, src.shape, dtype=np.uint8)
    dst = touched(per_save * size).reshape(per_save, size)
    tier = _TierDaemon(root, shm, 4 * total + 256 * MiB, memory)
    firsts: list[float] = []
    waits: list[float] = []
    copies: list[float] = []
    afters: list[float] = []
    shapes: list[list[int]] = []
    hidden = parts = found = 0
    load_s = 0.0
    device: Optional[RegionReads] = None
    try:
        assert tier.client is not None
        for i in range(0, count, per_save):
            batch = keys[i:i + per_save]
            tier.client.save(batch, src[:len(batch)])
        tier.settle()
        tier.stop()
        tier.start()
        assert tier.client is not None
        device = paired_reads(tier.disk_dir, memory)
        for i in range(0, count, per_save):
            batch = keys[i:i + per_save]
            clock.events.clear()
            clock.on = True
            t0 = time.perf_counter()
            found += tier.client.load_found(batch, dst[:len(batch)])
            t1 = time.perf_counter()
            load_s += t1 - t0
            clock.on = False
            line = _timeline(clock.events, t0, t1)
            firsts.append(line.first)
            waits += line.waits
            copies += line.copies
            afters.append(line.after_last)
            shapes.append(line.values)
            hidden += line.hidden
            parts += len(line.copies)
            device.read(len(batch) * size)
    finally:
        if device is not None:
            device.close()
        tier.close()
    if found != count:
        raise RuntimeError(f"the loads found {found} of {count} objects")
    shape = [n * size for n in max(shapes, key=shapes.count)]  # (whole loads: alike)
    unit, unit_name = (MiB, "MiB") if not any(n % MiB for n in shape) else (1024, "KiB")
    row: dict[str, object] = {
        "name": name, "size": size, "load_bytes": per_save * size, "loads": len(firsts),
        "parts_per_load": parts / len(firsts), "part_bytes": remote.LOAD_PART_BYTES,
        "parts": shape, "window": remote.LOAD_WINDOW, "found": found,
        "after_last_ms": statistics.median(afters) * 1e3,
        "first_part_ms": statistics.median(firsts) * 1e3,
        "wait_ms": statistics.median(waits) * 1e3 if waits else 0.0,
        "copy_ms": statistics.median(copies) * 1e3,
        "hidden_copies": hidden / max(1, parts - len(firsts)),
        "load_gbps": found * size / load_s / 1e9, "device_gbps": device.gbps()}
    say(f"| {name} | {' + '.join(str(n // unit) for n in shape)} {unit_name} | "
        f"{row['first_part_ms']:.1f} | {row['wait_ms']:.1f} | {row['copy_ms']:.1f} | "
        f"{100 * float(row['hidden_copies']):.0f} % | {row['after_last_ms']:.1f} | "  # type: ignore[arg-type]
        f"{row['load_gbps']:.2f} | {row['device_gbps']:.2f} |")
    return row


def main(argv: list[str]) -> int:
    run = Breakdown(argv, __doc__.split("\n\n")[0], "disk_load_breakdown",
                    "the daemon's shared memory and the device reads' buffers in huge "
                    "pages (as ems bench --disk-huge-pages)")
    run.print_table_head(
        ["values", "parts of a load", "first part ms", "wait ms", "copy ms", "copies hidden",
         "after the last answer ms", "load GB/s", "device GB/s"],
        "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    clock = Clock()
    rows = run.measure(SIZES, lambda root, name, size, total, shm: measure(
        root, name, size, total, shm, clock, run.memory, print), clock.close)
    path = run.write(rows)
    print(f"medians per load and per part; load average {os.getloadavg()[0]:.2f}; "
          f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
