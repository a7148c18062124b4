#!/usr/bin/env python3
"""Where the time of a spill to disk goes through ``ems-server --disk``: the client's
save chain, the daemon's CPU, and how busy the device was.

    python benchmarks/disk_spill_breakdown.py            # table, disk_spill_breakdown.json
    python benchmarks/disk_spill_breakdown.py --out DIR --mib 512 --shm-mib 128

The shapes are ``ems bench --disk``'s spill (1 GiB per value size through 256 MiB of
shared memory, saves of 32 MiB by one client, as fast as the daemon takes them), for
its three value sizes. A save goes Reserve -> copy -> Commit, in slices of 16 MiB with
the next slice's Reserve in flight while one is copied
(``ems.client.remote.RemoteTransport._save_reserved``). This script wraps the client's
waits for answers, its copies into shared memory and its Commit with a clock
(``RemoteTransport._reply``, ``V0Mover.to_pool``, ``RemoteTransport._commit``) and
reports, per value saved (the run's sums over its values):

* **reserve waits**: the client waiting for a Reserve's answer (the first slice's, and
  what the copy of a slice did not hide of the next one's);
* **copies**: the client copying values into shared memory;
* **commit wait**: the client waiting for the Commit's answer (the daemon commits, and
  hands the values to the disk's writers);
* **client's own**: the rest of a save call (the SDK's checks, keys, the requests);
* **after the saves**: from the last save's return until nothing waits or runs for the
  disk (the daemon's ``disk`` report);
* **device busy / depth**: the share of the run during which the device had a request
  in flight, and its average number in flight (``/sys/dev/block/MAJ:MIN/stat`` of the
  directory's device: ``io_ticks`` and ``time_in_queue`` over the run's seconds);
* **CPU**: of the client, of the daemon's event loop (its main thread) and of its other
  threads (the disk's writers, mostly), per value.

One client saves one call at a time, so the save chain (the four client columns) is the
spill's time per value unless the disk is slower; the device busy share says which.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from ems.bench.disk import (
    SAVE_BATCH_BYTES,
    SIZES,
    Breakdown,
    Memory,
    _key,
    _TierDaemon,
)
from ems.bench.systems import touched
from ems.client import remote
from ems.client.movers import V0Mover

MiB = 1 << 20


class Clock:
    """The client's waits for answers, copies and Commits, while ``on``: (kind, start,
    end)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self.on = False
        reply, to_pool = remote.RemoteTransport._reply, V0Mover.to_pool
        commit_ = remote.RemoteTransport._commit

        def timed_reply(transport: Any, flight: Any, task: Any, spin: bool = False) -> Any:
            t0 = time.perf_counter()
            got = reply(transport, flight, task, spin)
            if self.on:
                self.events.append(("answer", t0, time.perf_counter()))
            return got

        def timed_copy(mover: V0Mover, items: Any, locs: Any, task: Any) -> None:
            t0 = time.perf_counter()
            to_pool(mover, items, locs, task)
            if self.on:
                self.events.append(("copy", t0, time.perf_counter()))

        def timed_commit(transport: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            got = commit_(transport, *args, **kwargs)
            if self.on:
                self.events.append(("commit", t0, time.perf_counter()))
            return got
        remote.RemoteTransport._reply = timed_reply  # type: ignore[method-assign,assignment]
        V0Mover.to_pool = timed_copy  # type: ignore[method-assign,assignment]
        remote.RemoteTransport._commit = timed_commit  # type: ignore[method-assign,assignment]
        self._undo = (reply, to_pool, commit_)

    def close(self) -> None:
        reply, to_pool, commit_ = self._undo
        remote.RemoteTransport._reply = reply  # type: ignore[method-assign]
        V0Mover.to_pool = to_pool  # type: ignore[method-assign]
        remote.RemoteTransport._commit = commit_  # type: ignore[method-assign]

    def split(self) -> tuple[float, float, float]:
        """Seconds of the events so far: (reserve waits, copies, commit waits); an
        answer inside a Commit is the Commit's."""
        commits = [(a, b) for kind, a, b in self.events if kind == "commit"]
        reserve = copies = committing = 0.0
        for kind, a, b in self.events:
            if kind == "copy":
                copies += b - a
            elif kind == "answer":
                if any(c0 <= a and b <= c1 for c0, c1 in commits):
                    committing += b - a
                else:
                    reserve += b - a
        return reserve, copies, committing


class DeviceStat(NamedTuple):
    """The block device's counters (``/sys/dev/block/MAJ:MIN/stat``), in ms."""

    io_ticks: int  # ms during which a request was in flight
    time_in_queue: int  # ms of requests in flight, summed over the requests

    @classmethod
    def of(cls, directory: Path) -> Optional[DeviceStat]:
        """The counters of the device ``directory`` lies on (None where sysfs has none:
        tmpfs, overlay)."""
        dev = os.stat(directory).st_dev
        path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
        try:
            with open(path) as f:
                fields = [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return None
        return cls(fields[9], fields[10])


def _threads_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of process ``pid``'s main thread and of its other threads (those
    alive now: the daemon's writers live as long as it does)."""
    tick = os.sysconf("SC_CLK_TCK")
    main = others = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if tid == str(pid):
            main += cpu
        else:
            others += cpu
    return main, others


def measure(root: Path, name: str, size: int, total: int, shm: int, clock: Clock,
            memory: Memory, say: Callable[[str], None]) -> dict[str, object]:
    count = total // size
    keys = [_key(size, i) for i in range(count)]
    per_save = max(1, min(SAVE_BATCH_BYTES, shm // 4) // size)
    src = touched(per_save * size).reshape(per_save, size)
    src[:] = np.random.default_rng(size).integers(0, 256, src.shape, dtype=np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    tier = _TierDaemon(root, shm, 4 * total + 256 * MiB, memory)
    try:
        assert tier.client is not None and tier.daemon is not None
        pid = tier.daemon.service.pid
        d0, dev0 = tier.disk(), DeviceStat.of(root)
        main0, others0 = _threads_cpu_s(pid)
        clock.events.clear()
        clock.on = True
        client0 = time.process_time()
        t0 = time.perf_counter()
        for i in range(0, count, per_save):
            batch = keys[i:i + per_save]
            tier.client.save(batch, src[:len(batch)])
        saved = time.perf_counter()
        client_cpu = time.process_time() - client0
        clock.on = False
        d1 = tier.settle()
        t1 = time.perf_counter()
        dev1 = DeviceStat.of(root)
        main1, others1 = _threads_cpu_s(pid)
    finally:
        tier.close()
    written = d1.bytes_written - d0.bytes_written
    if written != count * size:
        raise RuntimeError(f"{written} bytes reached the disk of {count * size} saved")
    took = t1 - t0
    reserve, copies, committing = clock.split()
    us = 1e6 / count
    row: dict[str, object] = {
        "name": name, "size": size, "count": count, "save_bytes": per_save * size,
        "spill_gbps": written / took / 1e9, "values_per_s": count / took,
        "reserve_wait_us": reserve * us, "copy_us": copies * us,
        "commit_wait_us": committing * us,
        "client_own_us": (saved - t0 - reserve - copies - committing) * us,
        "after_saves_ms": (t1 - saved) * 1e3,
        "client_cpu_us": client_cpu * us, "daemon_loop_cpu_us": (main1 - main0) * us,
        "daemon_threads_cpu_us": (others1 - others0) * us,
        "save_waits": d1.save_waits - d0.save_waits,
        "device_busy": None, "device_depth": None}
    if dev0 is not None and dev1 is not None:
        row["device_busy"] = (dev1.io_ticks - dev0.io_ticks) / (took * 1e3)
        row["device_depth"] = (dev1.time_in_queue - dev0.time_in_queue) / (took * 1e3)
    say(_line(row))
    return row


def _line(r: dict[str, Any]) -> str:
    busy = "–" if r["device_busy"] is None else f"{100 * r['device_busy']:.0f} %"
    depth = "–" if r["device_depth"] is None else f"{r['device_depth']:.1f}"
    return (f"| {r['name']} | {r['values_per_s']:,.0f} | {r['spill_gbps']:.2f} | {busy} | "
            f"{depth} | {r['reserve_wait_us']:.1f} | {r['copy_us']:.1f} | "
            f"{r['commit_wait_us']:.1f} | {r['client_own_us']:.1f} | "
            f"{r['after_saves_ms']:.0f} | {r['client_cpu_us']:.1f} / "
            f"{r['daemon_loop_cpu_us']:.1f} / {r['daemon_threads_cpu_us']:.1f} |")


def main(argv: list[str]) -> int:
    run = Breakdown(argv, __doc__.split("\n\n")[0], "disk_spill_breakdown",
                    "the daemon's shared memory in huge pages (as ems bench "
                    "--disk-huge-pages)")
    run.print_table_head(
        ["values", "values/s", "GB/s", "device busy", "device depth", "reserve waits us",
         "copies us", "commit wait us", "client's own us", "after the saves ms",
         "CPU us: client / daemon loop / daemon threads"],
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    clock = Clock()
    rows = run.measure(SIZES, lambda root, name, size, total, shm: measure(
        root, name, size, total, shm, clock, run.memory, print), clock.close)
    path = run.write(rows, cpus=os.cpu_count())
    print(f"per value saved; load average {os.getloadavg()[0]:.2f}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
