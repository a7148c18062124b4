#!/usr/bin/env python3
"""Where the time of a load of disk-resident objects goes through ``ems-server --disk``:
per batch, the whole load, the same load again from shared memory, the client's copy
of the same bytes alone, and the disk engine's read of the same records alone.

    python benchmarks/disk_load_breakdown.py               # table, disk_load_breakdown.json
    python benchmarks/disk_load_breakdown.py --out DIR --mib 128 --shm-mib 32

The defaults (256 MiB through 64 MiB, batches of 16 MiB) are ``ems bench --disk``'s.

For each value size (1 MiB and 256 KiB, those of issue #28 item 3) a daemon with
``--shm-mib`` of shared memory takes ``--mib`` of saves (paced as ``ems bench --disk``
paces them, so that they reach the disk) and the objects shared memory evicted are
loaded back in batches of a quarter of shared memory:

* **disk load**: ``load`` of a batch of evicted objects (the daemon plans the fetch, the
  tier reads each value into its reservation on the reader threads, the reply, then the
  client copies out of shared memory): wall time per batch.
* **shm load**: the same batch loaded again at once (now in shared memory): the round
  trip and the client's copy, no disk.
* **copy**: the client's copy alone, the same bytes between two of its buffers.
* **store read**: after the daemon stopped (SIGTERM: flush, checkpoint), a
  ``DiskStore`` opened on its directory reads the same records, in the same batches,
  on the tier's thread count (``io_threads``), into page-aligned memory: the disk part
  alone (one ``preadv`` per value, checksum).
* **limit**: the device's ``O_DIRECT`` read of as many values of the size, sequential,
  ``io_threads`` deep, in the same directory (``ems bench --disk``'s limit; best of 2).
* **restart**: the daemon started again on that directory, shared memory empty, the
  same batches loaded (disk load after restart) and again (shm load).

Then ``disk load − shm load`` is the fetch (until the reply) and ``fetch − store read``
what the daemon adds to the disk part; since the reads and the copy run one after
the other, the best a design that overlaps them can reach is about
``max(store read, copy)`` per batch instead of ``store read + copy + round trip``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ems.bench.disk import (
    IO_THREADS,
    _cpu_s,
    _key,
    _load_all,
    _parallel,
    _TierDaemon,
    device_limit,
)
from ems.bench.report import commit
from ems.bench.systems import EmsSystem, touched
from ems.disk import DiskSettings, DiskStore
from ems.keys import v0_storage_keys
from ems.server.tenants import ANONYMOUS

MiB = 1 << 20
SIZES = (("1 MiB", 1 << 20), ("256 KiB", 256 << 10))


def _batches(keys: list[str], per: int) -> list[list[str]]:
    return [keys[i:i + per] for i in range(0, len(keys), per)]


def _loads(client: EmsSystem, batches: list[list[str]], dst: np.ndarray, pid: int
           ) -> dict[str, float]:
    """Each batch loaded (from the disk), then again (from shared memory): mean seconds
    per batch of each, and the daemon's and the client's CPU seconds of the disk loads."""
    disk = shm = 0.0
    found = 0
    cpu = ccpu = 0.0
    for b in batches:
        d0, c0 = _cpu_s(pid), time.process_time()
        s, n = _load_all(client, b, dst[:len(b)])
        cpu += _cpu_s(pid) - d0
        ccpu += time.process_time() - c0
        disk += s
        found += n
        s2, n2 = _load_all(client, b, dst[:len(b)])
        if n2 != len(b):
            raise RuntimeError(f"the reload from shared memory found {n2} of {len(b)}")
        shm += s2
    asked = sum(len(b) for b in batches)
    return {"disk_load_s": disk / len(batches), "shm_load_s": shm / len(batches),
            "found": found, "asked": asked,
            "daemon_cpu_s": cpu / len(batches), "client_cpu_s": ccpu / len(batches)}


def _store_read(directory: Path, cap: int, batches: list[list[str]], size: int
                ) -> dict[str, float]:
    """The engine alone: the same records, batch by batch, ``IO_THREADS`` deep."""
    store = DiskStore(DiskSettings(str(directory), cap, checkpoint_s=0))
    store.open()
    store.wait_recovered(60)
    arena = mmap.mmap(-1, size * IO_THREADS)
    slots = [memoryview(arena)[t * size:(t + 1) * size] for t in range(IO_THREADS)]
    took = 0.0
    outcomes: dict[str, int] = {}
    tenants = [bytes.fromhex(d[1:]).decode() for d in os.listdir(directory)
               if d.startswith("t") and os.path.isdir(directory / d)]
    tenant = tenants[0] if len(tenants) == 1 else ANONYMOUS
    try:
        for batch in batches:
            b = v0_storage_keys(batch)  # the keys the daemon stored (V0 str keys)

            def get(t: int, i: int, b: list[str] = b) -> None:
                r = store.read(tenant, b[i], slots[t], time.monotonic() + 60).value
                outcomes[r] = outcomes.get(r, 0) + 1
            took += _parallel(IO_THREADS, len(b), get)
        st = store.statistics()
    finally:
        store.close()  # a checkpoint and the clean marker, for the restart
        for s in slots:
            s.release()
        arena.close()
    asked = sum(len(b) for b in batches)
    if st.hits != asked:
        raise RuntimeError(f"the store read {st.hits} of {asked} records: "
                           f"{outcomes}, tenants {tenants}")
    return {"store_read_s": took / len(batches), "direct_reads": st.direct_reads,
            "buffered_reads": st.buffered_reads}


def _copy_s(dst: np.ndarray, src: np.ndarray, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return (time.perf_counter() - t0) / reps


def measure(root: Path, name: str, size: int, total: int, shm: int,
            say: Callable[[str], None]) -> dict[str, object]:
    count = total // size
    keys = [_key(size, i) for i in range(count)]
    per_save = max(1, (shm // 4) // size)
    per_load = per_save
    src = touched(per_save * size).reshape(per_save, size)
    src[:] = np.random.default_rng(size).integers(0, 256, src.shape, dtype=np.uint8)
    dst = touched(per_load * size).reshape(per_load, size)
    cap = 4 * total + 256 * MiB
    tier = _TierDaemon(root, shm, cap)
    try:
        assert tier.client is not None and tier.daemon is not None
        for i in range(0, count, per_save):
            while tier.disk().queued_write_bytes > shm // 4:
                time.sleep(0.002)
            batch = keys[i:i + per_save]
            tier.client.save(batch, src[:len(batch)])
        tier.settle()
        evicted = keys[:max(0, count - 2 * (shm // size))]
        batches = _batches(evicted, per_load)
        d0 = tier.disk()
        before = _loads(tier.client, batches, dst, tier.daemon.service.pid)
        d1 = tier.disk()
        if not np.array_equal(dst[0], src[(len(evicted) - 1) // per_load * per_load
                                          % per_save]):
            raise RuntimeError("a load returned other bytes than its save")
        tier.stop()
        store = _store_read(tier.disk_dir, cap, batches, size)
        tier.start()
        assert tier.client is not None and tier.daemon is not None
        after = _loads(tier.client, batches, dst, tier.daemon.service.pid)
        d2 = tier.disk()
    finally:
        tier.close()
    copy = _copy_s(dst, touched(dst.nbytes).reshape(dst.shape), 20)
    limit_read = max(device_limit(root, size, max(IO_THREADS, len(evicted)), IO_THREADS)[1]
                     for _ in range(2))
    batch_bytes = per_load * size
    row: dict[str, object] = {
        "name": name, "size": size, "batch_bytes": batch_bytes, "batches": len(batches),
        "objects": len(evicted), "shm_bytes": shm, "io_threads": IO_THREADS,
        "limit_read_gbps": limit_read, "evicted": before, "restart": after, "store": store,
        "copy_s": copy,
        "daemon_direct_reads": d2.direct_reads, "daemon_buffered_reads":
        d2.buffered_reads, "read_latency_p50_ms": (d1.read_latency_p50_s or 0) * 1e3,
        "disk_hits_evicted": d1.tier.hits - d0.tier.hits}
    for phase in ("evicted", "restart"):
        p = before if phase == "evicted" else after
        fetch = p["disk_load_s"] - p["shm_load_s"]
        say(f"| {name} | {phase} | {p['found']}/{p['asked']} | "
            f"{p['disk_load_s'] * 1e3:.1f} | {p['shm_load_s'] * 1e3:.1f} | "
            f"{fetch * 1e3:.1f} | {store['store_read_s'] * 1e3:.1f} | {copy * 1e3:.1f} | "
            f"{batch_bytes / p['disk_load_s'] / 1e9:.2f} | "
            f"{batch_bytes / store['store_read_s'] / 1e9:.2f} | {limit_read:.2f} |")
    return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="working set per size, MiB")
    ap.add_argument("--shm-mib", type=int, default=64,
                    help="the daemon's shared memory, MiB (batches are a quarter)")
    ap.add_argument("--dir", default=None, help="directory on the disk (default: --out)")
    ap.add_argument("--out", default=".", help="directory for disk_load_breakdown.json")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    base = Path(args.dir or args.out) / "disk-load-breakdown.tmp"
    base.mkdir(parents=True, exist_ok=True)
    print("| values | phase | found | disk load ms | shm load ms | fetch ms | "
          "store read ms | copy ms | load GB/s | store GB/s | "
          "O_DIRECT limit GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    load0 = os.getloadavg()[0]
    try:
        for name, size in SIZES:
            rows.append(measure(base, name, size, args.mib * MiB, args.shm_mib * MiB,
                                print))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    path = os.path.join(args.out, "disk_load_breakdown.json")
    # (the run's commit before the file is opened: an open JSON is a dirty tree)
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "argv": ["DIR" if a.startswith("/") else a for a in argv],
           "ems": commit(), "mib": args.mib, "shm_mib": args.shm_mib, "rows": rows,
           "loadavg": {"start": load0, "end": os.getloadavg()[0]}}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"per batch (mean); fetch = disk load - shm load; load average "
          f"{os.getloadavg()[0]:.2f}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
