"""``ems bench --disk``: the disk tier through a real daemon, beside the device's limit.

An ``ems-server --disk DIR`` whose shared memory (``--disk-shm``) is a quarter of the
working set (``--disk-mib`` MiB per value size) takes the saves of one client:

* **spill**: the client saves the working set in batches of 32 MiB (at most a quarter
  of shared memory, as every batch below), as fast as the daemon takes them; GB/s of
  objects that reached the disk, from the first save until nothing waits or runs for
  the disk (the daemon's ``disk`` report). A save that finds shared memory full of
  objects not on disk yet waits for the tier's writer (back-pressure, counted as
  ``save_waits``); an object evicted unwritten anyway is counted (``unwritten``,
  ``evicted_before_write``).
* **load evicted**: the objects shared memory evicted, loaded back (from the disk) in
  batches of 64 MiB. GB/s of the objects found (the JSON has found / asked).
* **load after restart**: the daemon stopped (SIGTERM) and started again on the same
  directory, shared memory empty; once its recovery has ended (``restart_s``: from the
  start to the end of recovery), every object loaded back from the disk.

Value sizes: V0's 1 MiB and V1-sized blocks of 256 KiB and 16 KiB (all saved through V0
keys of 64 characters, as long as V1's hashes: the tier stores one record per key either
way, and a record's head holds its key). The limits are measured in the same run, the
same directory and the tier's thread count (``io_threads``), ``O_DIRECT`` (no page cache:
what the device does):

* **write**: sequential writes of the same bytes to a fresh file, at the value size
  and at the store's write buffer size (the tier writes batches of that size), and in
  write buffers appended to fresh files of a region's size one after the other (the
  tier's own way), right before and right after each run of the tier: per way the mean
  of the two (the device's speed over the run), and the best way.
* **read**: the tier's own region files (the very bytes a load reads, where they lie
  on the device), read in whole requests of the device, about the store's read chunk
  (:func:`limit_read_chunk`: a read the kernel splits is not the device's best), batch
  by batch beside the load: each batch the tier
  loads is followed by a read of as many bytes of those files (in the order the keys
  were saved: about the bytes the batch has just read), and the load's GB/s is taken
  against the GB/s of those reads, over the same seconds of the device. Fresh files
  read at the value size and the read chunk are in the JSON too (here they read
  slower than the region files).

**Header overhead**: the bytes the tier wrote to disk beyond the values (batch heads
and padding), as a share of all it wrote; **records/s**: values spilled per second.

The device's speed drifts from second to second on a shared machine (a virtual disk
here read the same kind of file at 1.7 and 3.0 GB/s in two repetitions a few seconds
apart): hence the reads paired batch by batch, and ``--disk-reps`` repetitions (3),
each ratio that run's figure against its own limits; the table shows the median of the
runs (of each ratio, and of each figure; every run is in the JSON). Deleted files are
synced before each write limit: this file system discards freed blocks when its
journal commits, and a discard of the last run's gigabyte would slow the next
measurement.

For the profile of a load, the same batches from shared memory, and the CPU seconds
per GB of the daemon and the client during the load after the restart; the load
average of the machine is recorded (other processes take CPUs these copies and
checksums need). The engine alone (``ems.disk.DiskStore``, no daemon, no client) is
measured once per size, so that a gap shows where it is lost.

Recovery: a synthetic checkpoint of ``--disk-records`` records (1M) loaded as at a clean
restart, and a scan of ``--disk-scan`` records of 4 KiB written without a checkpoint (a
crash before the first one), twice: saved one record at a time (a batch head per
record, the worst case) and in saves of 64 (a V1 save of a prefill's blocks: one head
per save): seconds per million records each.

Everything is written under ``--disk-dir`` (default: the ``--out`` directory) in a
temp directory removed at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from ems.bench.report import commit, guarded_run, write_json
from ems.bench.systems import EmsDaemon, EmsSystem, touched
from ems.client.remote import server_report
from ems.config import PoolSettings
from ems.disk import DiskSettings, DiskStore, WriteResult
from ems.disk.index import columns
from ems.disk.records import (
    ALIGN,
    MAX_NAME_BYTES,
    Checkpoint,
    CheckpointRegion,
    CheckpointTenant,
    encode_checkpoint,
    record_span,
)
from ems.disk.recovery import CHECKPOINT, recover, region_path, tenant_dir
from ems.protocol.report import DaemonReport, DiskReport
from ems.server.config import HUGE_PAGES, DiskConfig
from ems.server.tenants import huge_page_bytes, meminfo_kib
from ems.testing.server import disk_after_recovery

__all__ = ["SIZES", "Breakdown", "RegionReads", "add_arguments", "case", "checkpoint_load",
           "device_limit", "limit_read_chunk", "main", "paired_reads", "region_write_limit",
           "run", "scan", "store_speed"]

MiB = 1 << 20
#: (name, value bytes) of the measured cases
SIZES = (("V0 1 MiB", 1 << 20), ("V1 block 256 KiB", 256 << 10),
         ("V1 block 16 KiB", 16 << 10))
#: bytes of the store's write buffer: the size of the tier's writes
WRITE_BUFFER_BYTES: int = next(f.default for f in dataclasses.fields(DiskSettings)
                               if f.name == "write_buffer_bytes")  # type: ignore[assignment]
#: bytes of a region file (the tier appends its write buffers to one after the other)
REGION_BYTES: int = next(f.default for f in dataclasses.fields(DiskSettings)
                         if f.name == "region_bytes")  # type: ignore[assignment]
#: bytes of the store's reads: a run of back-to-back records is read in transfers of
#: this size (``DiskSettings.chunk_bytes``)
READ_CHUNK_BYTES: int = next(f.default for f in dataclasses.fields(DiskSettings)
                             if f.name == "chunk_bytes")  # type: ignore[assignment]
#: the tier's worker threads, the depth at which the limit is measured
IO_THREADS: int = next(f.default for f in dataclasses.fields(DiskConfig)
                       if f.name == "io_threads")  # type: ignore[assignment]
SAVE_BATCH_BYTES = 32 * MiB
LOAD_BATCH_BYTES = 64 * MiB


# ------------------------------------------------------------------- the device
def limit_read_chunk(directory: Path, sys_root: str = "/sys", page: int = mmap.PAGESIZE
                     ) -> int:
    """The read size of the device's read limit (:class:`RegionReads`): as many of the
    device's largest requests into scattered memory as fit in the tier's read chunk
    (:data:`READ_CHUNK_BYTES`), so no read of the limit is split into a request and a
    runt.

    A direct read gives the block layer one segment per memory page it fills, unless
    pages happen to lie next to each other in physical memory; a request takes at most
    ``max_segments`` of them and ``max_sectors_kb``. The limit's own buffers lie
    scattered: on the benchmark VM's virtio disk (``max_segments`` 254) every 1 MiB read
    of the limit went to the device as two requests (``/sys/block/vda/stat``: 2.00 a
    read) and read 1.29-1.37 GB/s, against 1.60-1.61 in reads of 1012 KiB (one request
    each; three alternating pairs, 8 deep), so the limit was understated. (The tier
    itself reads 1 MiB: its shared memory is populated in order and its reads went out
    as 1.05 requests per MiB; cut at 1012 KiB, a reader's share of 2 MiB became three
    reads, and its loads were slower: ``DiskSettings.chunk_bytes``.) A request here is
    ``max_segments - 1`` pages (a read that starts inside a page fills one more) and at
    most ``max_sectors_kb``, from ``/sys/dev/block/MAJ:MIN/queue`` of the directory's
    device or of the disk its partition is on; :data:`READ_CHUNK_BYTES` where sysfs
    has no answer (tmpfs, overlay). ``page``: the buffers' page size (huge pages: a
    segment each, so a request is ``max_sectors_kb``)."""
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return READ_CHUNK_BYTES
    base = os.path.join(sys_root, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
    for queue in (os.path.join(base, "queue"), os.path.join(base, "..", "queue")):
        try:
            with open(os.path.join(queue, "max_segments")) as f:
                segments = int(f.read())
            with open(os.path.join(queue, "max_sectors_kb")) as f:
                sectors = int(f.read()) << 10
        except (OSError, ValueError):
            continue
        request = min((segments - 1) * page, sectors, READ_CHUNK_BYTES)
        request -= request % ALIGN
        if request <= 0:
            break
        return READ_CHUNK_BYTES // request * request
    return READ_CHUNK_BYTES


def _parallel(threads: int, count: int, work: Callable[[int, int], object]) -> float:
    """Run ``work(t, i)`` for i in range(count) on threads t in range(``threads``);
    seconds taken."""
    nxt = [0]
    lock = threading.Lock()

    def run(t: int) -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= count:
                return
            work(t, i)

    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class Memory:
    """The pages of the run's buffers: the daemon's shared memory (``ems-server
    --huge-pages``) and the limits' own buffers are of the same kind, 4 KiB pages or the
    system's huge pages, so the tier is measured against the device's limit into the
    memory it uses (huge pages give the limit more too: O_DIRECT reads of 1 MiB, 8 deep,
    2.11-2.14 GB/s into huge pages against 1.71-2.05 into 4 KiB pages, two pairs)."""

    huge_pages: bool = False
    #: bytes of one page (the unit of a direct transfer's segments)
    page: int = mmap.PAGESIZE

    def daemon_args(self) -> list[str]:
        return ["--huge-pages", "on" if self.huge_pages else "off"]

    def buffers(self, threads: int, size: int) -> list[memoryview]:
        """A page-aligned buffer of ``size`` random bytes per thread (``O_DIRECT``'s
        memory; release the views when done), all in one mapping."""
        total = -(-threads * size // self.page) * self.page
        if self.huge_pages:
            fd = os.memfd_create("ems-bench", os.MFD_CLOEXEC | os.MFD_HUGETLB)
            try:
                os.ftruncate(fd, total)
                m = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        else:
            m = mmap.mmap(-1, total)
        m.write(os.urandom(threads * size))
        whole = memoryview(m)
        views = [whole[t * size:(t + 1) * size] for t in range(threads)]
        whole.release()  # (the slices keep the mapping until they are released)
        return views


def choose_memory(mode: str, shm_bytes: int, threads: int) -> Memory:
    """``--disk-huge-pages``: ``off``; ``on`` (an error without enough free huge pages);
    ``auto``: huge pages where the system has enough free for the daemon's shared memory
    and the limits' buffers, else 4 KiB pages."""
    if mode == "off":
        return Memory()
    page = huge_page_bytes()
    need = shm_bytes + threads * (max(WRITE_BUFFER_BYTES, 1 << 20) + READ_CHUNK_BYTES)
    free = (meminfo_kib("HugePages_Free") or 0) * page if page else 0
    if page and free >= need + 4 * page:
        return Memory(True, page)
    if mode == "on":
        raise SystemExit(f"ems bench: --disk-huge-pages on needs {need >> 20} MiB of free "
                         f"huge pages, the system has {free >> 20} MiB (vm.nr_hugepages)")
    return Memory()


def device_limit(root: Path, size: int, count: int, threads: int,
                 memory: Memory = Memory()) -> tuple[float, float]:
    """``O_DIRECT`` write then read of ``count`` values of ``size`` bytes, ``threads``
    deep, sequential offsets, in ``root``: GB/s each way."""
    path = root / "limit.dat"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_DIRECT", 0), 0o600)
    views = memory.buffers(threads, size)
    try:
        w = _parallel(threads, count, lambda t, i: os.pwritev(fd, [views[t]], i * size))
        os.fdatasync(fd)
        r = _parallel(threads, count, lambda t, i: os.preadv(fd, [views[t]], i * size))
    finally:
        os.close(fd)
        os.unlink(path)
        for v in views:
            v.release()
    return count * size / w / 1e9, count * size / r / 1e9


def region_write_limit(root: Path, nbytes: int, region_bytes: int, chunk: int,
                       threads: int, memory: Memory = Memory()) -> float:
    """``O_DIRECT`` writes of ``nbytes`` into fresh files of ``region_bytes`` each, one
    after the other, in ``chunk``-byte appends, ``threads`` deep (the tier's way: its
    writers append write buffers to the tenant's current region file): GB/s."""
    per = max(1, region_bytes // chunk)
    count = max(threads, nbytes // chunk)
    views = memory.buffers(threads, chunk)
    fds: dict[int, int] = {}
    lock = threading.Lock()

    def write(t: int, i: int) -> None:
        with lock:
            fd = fds.get(i // per)
            if fd is None:
                fd = fds[i // per] = os.open(root / f"limit-{i // per}.region",
                                             os.O_CREAT | os.O_RDWR
                                             | getattr(os, "O_DIRECT", 0), 0o600)
        os.pwritev(fd, [views[t]], i % per * chunk)
    try:
        took = _parallel(threads, count, write)  # (the sync untimed, as device_limit's)
        for fd in fds.values():
            os.fdatasync(fd)
    finally:
        for n, fd in fds.items():
            os.close(fd)
            os.unlink(root / f"limit-{n}.region")
        for v in views:
            v.release()
    return count * chunk / took / 1e9


class RegionReads:
    """``O_DIRECT`` reads of the tier's own region files under ``directory`` (the very
    bytes a load reads, where they lie on the device), in ``chunk``-byte reads,
    ``threads`` deep: :meth:`read` moves the next ``nbytes`` of them (from the first
    file on, in the order the keys were saved and are loaded, cycling) and says how
    long it took. Each batch of a load is followed by such a read of as many bytes:
    about the bytes the batch has just read, over the same seconds of the device
    (read second: a cache between this machine and the device would help the limit,
    not the tier)."""

    def __init__(self, directory: Path, chunk: int, threads: int,
                 memory: Memory = Memory()) -> None:
        self.chunk, self.threads = chunk, threads
        self._fds = [os.open(str(p), os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                     for p in sorted(directory.rglob("*.region"))]
        self._spots = [(fd, at) for fd in self._fds
                       for at in range(0, os.fstat(fd).st_size // chunk * chunk, chunk)]
        self._next = 0
        self._views = memory.buffers(threads, chunk)
        self.bytes = 0
        self.seconds = 0.0

    def read(self, nbytes: int) -> float:
        spots = self._spots
        if not spots:
            return 0.0
        n = max(1, nbytes // self.chunk)
        first = self._next
        self._next = (first + n) % len(spots)
        views = self._views

        def read(t: int, i: int) -> None:
            fd, at = spots[(first + i) % len(spots)]
            os.preadv(fd, [views[t]], at)
        took = _parallel(self.threads, n, read)
        self.bytes += n * self.chunk
        self.seconds += took
        return took

    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def close(self) -> None:
        for v in self._views:
            v.release()
        for fd in self._fds:
            os.close(fd)


def paired_reads(directory: Path, memory: Memory) -> RegionReads:
    """The device's reads beside a load (:class:`RegionReads`): the tier's region files
    under ``directory``, in the limit's read size for ``memory``'s pages
    (:func:`limit_read_chunk`), :data:`IO_THREADS` deep, into ``memory``."""
    return RegionReads(directory, limit_read_chunk(directory, page=memory.page), IO_THREADS,
                       memory)


def store_speed(root: Path, size: int, count: int, threads: int) -> dict[str, Any]:
    """The engine alone: ``threads`` threads write ``count`` values into a fresh
    ``DiskStore`` in batches of a write buffer (as the tier hands it a save) and read
    them back one by one, from and into page-aligned memory."""
    path = root / "store"
    cap = count * record_span(size) * 2 + (256 * MiB)
    store = DiskStore(DiskSettings(str(path), cap, checkpoint_s=0))
    store.open()
    store.wait_recovered(60)
    per = max(1, min(count, WRITE_BUFFER_BYTES // size))
    arena = mmap.mmap(-1, size * per * threads)  # page aligned, like the daemon's arena
    arena.write(os.urandom(size * per * threads))
    slots = [memoryview(arena)[i * size:(i + 1) * size] for i in range(per * threads)]
    batches = -(-count // per)

    def put(t: int, b: int) -> None:
        ids = range(b * per, min(count, (b + 1) * per))
        got = store.write_batch("bench", [_key(size, i) for i in ids],
                                slots[t * per:t * per + len(ids)])
        if any(r is not WriteResult.WRITTEN for r in got):
            raise RuntimeError("write refused")

    def get(t: int, i: int) -> None:
        store.read("bench", _key(size, i), slots[t * per], time.monotonic() + 60)

    try:
        w = _parallel(threads, batches, put)
        store.checkpoint()  # durable, as the limit's fdatasync
        r = _parallel(threads, count, get)
        st = store.statistics()
    finally:
        store.close()
        for s in slots:
            s.release()
        arena.close()
        shutil.rmtree(path)
    if st.hits != count:
        raise RuntimeError(f"{st.hits} of {count} reads hit")
    return {"write_gbps": count * size / w / 1e9, "read_gbps": count * size / r / 1e9,
            "records_per_s": count / w, "batches": st.batches_written,
            "header_overhead": 1 - st.bytes_written / st.disk_bytes_written,
            "reads_buffered": st.buffered_reads, "writes_buffered": st.buffered_writes,
            "write_p99_ms": (st.write_latency_p99_s or 0) * 1e3,
            "read_p99_ms": (st.read_latency_p99_s or 0) * 1e3}


def _key(size: int, i: int) -> str:
    """The ``i``-th key of a case: 64 characters, as long as a V1 block hash."""
    return f"{size:08x}{i:056x}"


# ------------------------------------------------------------------- recovery

def checkpoint_load(root: Path, records: int) -> dict[str, Any]:
    """A clean restart's recovery of ``records`` records of 16 KiB in 64 MiB regions
    (sparse region files, a record per batch: the largest index for the bytes):
    seconds per million; and the encoding of that index."""
    path = root / "ckpt"
    rb = 64 * MiB
    span = record_span(16 << 10)
    per = rb // span
    nreg = -(-records // per)
    os.makedirs(tenant_dir(str(path), "bench"), mode=0o700)
    for r in range(1, nreg + 1):
        with open(region_path(str(path), "bench", r), "wb") as f:
            f.truncate(per * span)
    ids = range(records)
    keys = [f"{i:064x}" for i in ids]  # V1-like hashes
    t = CheckpointTenant("bench", keys, array("Q", (1 + i // per for i in ids)),
                         array("Q", ((i % per) * span + ALIGN for i in ids)),
                         array("Q", [16 << 10]) * records, array("Q", (1 + i for i in ids)),
                         array("Q", (i * 0x9E3779B97F4A7C15 % (1 << 64) for i in ids)))
    ck = Checkpoint(records + 1, nreg + 1,
                    [CheckpointRegion("bench", r, per * span) for r in range(1, nreg + 1)], [t])
    data = encode_checkpoint(ck)
    (path / CHECKPOINT).write_bytes(data)
    del keys, t
    t0 = time.perf_counter()
    c0 = time.process_time()
    got = recover(str(path), nreg * rb, rb, clean=True)
    load_s = time.perf_counter() - t0
    load_cpu_s = time.process_time() - c0
    if got.index.objects() != records or not got.scan_skipped:
        raise RuntimeError(f"checkpoint recovery found {got.index.objects()} of {records}")
    t0 = time.perf_counter()  # what the store's checkpoint does with this index
    snap = got.index.entries("bench")
    encode_checkpoint(Checkpoint(records + 1, nreg + 1, ck.regions,
                                 [CheckpointTenant("bench", *columns(snap))]))
    encode_s = time.perf_counter() - t0
    del got, snap, ck
    shutil.rmtree(path)
    return {"records": records, "load_s": load_s, "load_s_per_million": load_s / records * 1e6,
            "load_cpu_s_per_million": load_cpu_s / records * 1e6,
            "encode_s_per_million": encode_s / records * 1e6,
            "checkpoint_mib": len(data) / MiB}


_mincore = ctypes.CDLL(None, use_errno=True).mincore
_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_mincore.restype = ctypes.c_int


def resident_share(paths: Sequence[Path]) -> float:
    """The share of the files' pages that are in the page cache (``mincore(2)`` of a
    private mapping of each, which touches none of them): a scan reads them from
    memory or from the device. This VM's kernel pages out memory not used for a few
    seconds (DAMON's ``pageout`` scheme), page cache included, so a scan right after
    the writes may find part of them gone."""
    page = mmap.PAGESIZE
    total = resident = 0
    for path in paths:
        size = path.stat().st_size
        if not size:
            continue
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            pages = -(-size // page)
            vec = (ctypes.c_ubyte * pages)()
            buf = ctypes.c_char.from_buffer(mm)
            try:
                if _mincore(ctypes.addressof(buf), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path}")
            finally:
                del buf
            total += pages
            resident += sum(b & 1 for b in vec)
        finally:
            mm.close()
    return resident / total if total else 0.0


def scan(root: Path, records: int, threads: int, per_save: int = 1) -> dict[str, Any]:
    """Recovery by scan (no checkpoint: a crash before the first) of ``records``
    records of 4 KiB, written ``per_save`` to a save by ``threads`` writers at once
    (small saves that wait together share a batch: ``DiskStore.write_batch``)."""
    path = root / "scan"
    store = DiskStore(DiskSettings(str(path), records * record_span(4096) * 2 + 64 * MiB,
                                   checkpoint_s=0))
    store.open()
    store.wait_recovered(60)
    value = memoryview(bytes(4096))
    saves = -(-records // per_save)
    def save(s: int) -> None:
        ids = range(s * per_save, min(records, (s + 1) * per_save))
        store.write_batch("bench", [f"{i:064x}" for i in ids], [value] * len(ids))
    _parallel(threads, saves, lambda t, s: save(s))
    batches = store.statistics().batches_written  # fewer than saves: group commit
    store.close(clean=False)
    os.unlink(path / CHECKPOINT)
    resident = resident_share(sorted(path.rglob("*.region")))
    t0 = time.perf_counter()
    c0 = time.process_time()
    got = recover(str(path), records * record_span(4096) * 2, 64 * MiB, clean=False)
    took = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if got.index.objects() != records:
        raise RuntimeError(f"the scan found {got.index.objects()} of {records} records")
    shutil.rmtree(path)
    return {"records": records, "records_per_save": per_save, "writers": threads,
            "batches": batches, "records_per_batch": records / batches,
            "resident_share": resident, "scan_s": took,
            "scan_s_per_million": took / records * 1e6,
            "scan_cpu_s_per_million": cpu / records * 1e6}


# ------------------------------------------------------------ through the daemon

class _TierDaemon:
    """An ``ems-server --disk`` in ``root`` and one client of it; restartable."""

    def __init__(self, root: Path, shm_bytes: int, disk_bytes: int,
                 memory: Memory = Memory()) -> None:
        self.root = root
        self.shm_bytes = shm_bytes
        self.disk_dir = root / "disk"
        self.args = ["--disk", str(self.disk_dir), "--disk-capacity", str(disk_bytes),
                     "--disk-checkpoint-s", "60", *memory.daemon_args()]
        self.sock_dir = tempfile.mkdtemp(prefix="ems-bench-disk-")  # short socket path
        self.daemon: Optional[EmsDaemon] = None
        self.client: Optional[EmsSystem] = None
        self.start()

    def start(self) -> None:
        self.daemon = EmsDaemon(self.sock_dir, self.shm_bytes, str(self.root),
                                extra_args=self.args)
        self.client = EmsSystem("daemon", self.shm_bytes, socket_dir=self.sock_dir)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.daemon is not None:
            self.daemon.service.stop(timeout_s=120)  # SIGTERM: flush, checkpoint, mark
            self.daemon = None

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
            shutil.rmtree(self.disk_dir, ignore_errors=True)  # the next size starts empty

    @property
    def socket_path(self) -> str:
        return os.path.join(self.sock_dir, PoolSettings.SOCKET_NAME)

    def report(self) -> DaemonReport:
        return DaemonReport.from_wire(server_report(self.socket_path, 10))

    def disk(self) -> DiskReport:
        """The daemon's disk tier report (it runs with ``--disk``: always there)."""
        d = self.report().disk
        if d is None:
            raise RuntimeError("ems-server sent no disk report (not run with --disk?)")
        return d

    def settle(self, timeout_s: float = 300) -> DiskReport:
        """Wait until nothing waits or runs for the disk; its report then."""
        deadline = time.monotonic() + timeout_s
        while True:
            d = self.disk()
            if not d.queued_write_bytes and not d.inflight_write_bytes:
                return d
            if time.monotonic() > deadline:
                raise RuntimeError(f"the disk tier did not settle within {timeout_s} s: {d}")
            time.sleep(0.005)


class Breakdown:
    """The frame of a ``benchmarks/disk_*_breakdown.py`` script: ``ems bench --disk``'s
    shapes as options (``--mib``, ``--shm-mib``, ``--dir``, ``--out``,
    ``--huge-pages``), a work directory (:meth:`remove` it, whatever happened), and
    the run's JSON (its date, arguments, commit, shapes, rows and load average)."""

    def __init__(self, argv: Sequence[str], description: str, name: str,
                 memory_help: str) -> None:
        ap = argparse.ArgumentParser(description=description)
        ap.add_argument("--mib", type=int, default=1024, help="working set per size, MiB")
        ap.add_argument("--shm-mib", type=int, default=256,
                        help="the daemon's shared memory, MiB (a quarter of it per "
                             "save or load)")
        ap.add_argument("--dir", default=None, help="directory on the disk (default: --out)")
        ap.add_argument("--out", default=".", help=f"directory for {name}.json")
        ap.add_argument("--huge-pages", choices=HUGE_PAGES, default="auto", help=memory_help)
        args = ap.parse_args(argv)
        self.argv, self.name = list(argv), name
        self.mib, self.shm_mib, self.out = args.mib, args.shm_mib, args.out
        self.memory = choose_memory(args.huge_pages, args.shm_mib * MiB, IO_THREADS)
        os.makedirs(args.out, exist_ok=True)
        #: the runs' directory
        self.base = Path(args.dir or args.out) / f"{name.replace('_', '-')}.tmp"
        self.base.mkdir(parents=True, exist_ok=True)
        self._load0 = os.getloadavg()[0]
        self._ems = commit()

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)

    def print_table_head(self, columns: Sequence[str], rule: str) -> None:
        """The pages' kind, then the printed table's header (``columns``) and ``rule``."""
        print(f"pages: {'huge' if self.memory.huge_pages else '4 KiB'}")
        print(f"| {' | '.join(columns)} |")
        print(rule)

    def measure(self, sizes: Sequence[tuple[str, int]],
                one: Callable[[Path, str, int, int, int], dict[str, Any]],
                close: Callable[[], None]) -> list[dict[str, Any]]:
        """``one(work directory, name, size, working set, shared memory)`` of each of
        ``sizes``, its rows; then ``close()`` and the work directory removed, whatever
        happened."""
        rows = []
        try:
            for name, size in sizes:
                rows.append(one(self.base, name, size, self.mib * MiB, self.shm_mib * MiB))
        finally:
            close()
            self.remove()
        return rows

    def write(self, rows: list[dict[str, Any]], **fields: Any) -> str:
        """Write the JSON (the commit taken before the file is opened: an open JSON is
        a dirty tree); its path."""
        path = os.path.join(self.out, f"{self.name}.json")
        out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "argv": ["DIR" if a.startswith("/") else a for a in self.argv],
               "ems": commit(since=self._ems), "mib": self.mib, "shm_mib": self.shm_mib,
               "huge_pages": self.memory.huge_pages, **fields, "rows": rows,
               "loadavg": {"start": self._load0, "end": os.getloadavg()[0]}}
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        return path


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _load_all(client: EmsSystem, keys: Sequence[str], buf: np.ndarray,
              paired: Optional[RegionReads] = None) -> tuple[float, int]:
    """Load ``keys`` in batches of ``len(buf)``; seconds taken and keys found. With
    ``paired``, each batch is followed by a read of as many bytes of the region files
    (not counted in the seconds)."""
    n = buf.shape[0]
    found = 0
    took = 0.0
    for i in range(0, len(keys), n):
        batch = keys[i:i + n]
        t0 = time.perf_counter()
        found += client.load_found(batch, buf[:len(batch)])
        took += time.perf_counter() - t0
        if paired is not None:
            paired.read(buf[:len(batch)].nbytes)
    return took, found


def _load_paired(tier: _TierDaemon, keys: Sequence[str], buf: np.ndarray,
                 memory: Memory) -> tuple[float, int, float]:
    """:func:`_load_all` of ``keys`` through ``tier``'s client, each batch followed by a
    read of as many bytes of its region files: seconds, keys found, and the device's
    GB/s over those reads."""
    assert tier.client is not None
    paired = paired_reads(tier.disk_dir, memory)
    try:
        took, found = _load_all(tier.client, keys, buf, paired)
    finally:
        paired.close()
    return took, found, paired.gbps()


def tier_speed(root: Path, name: str, size: int, total_bytes: int, shm_bytes: int,
               memory: Memory = Memory()) -> dict[str, Any]:
    """Spill, load of the evicted objects, and load after a restart, of ``total_bytes``
    of ``size``-byte values through a daemon with ``shm_bytes`` of shared memory."""
    count = total_bytes // size
    keys = [_key(size, i) for i in range(count)]
    assert len(keys[0]) < MAX_NAME_BYTES
    per_save = max(1, min(SAVE_BATCH_BYTES, shm_bytes // 4) // size)
    src = touched(per_save * size).reshape(per_save, size)
    src[:] = np.random.default_rng(size).integers(0, 256, src.shape, dtype=np.uint8)
    dst = touched(max(1, min(LOAD_BATCH_BYTES, shm_bytes // 4) // size) * size
                  ).reshape(-1, size)
    tier = _TierDaemon(root, shm_bytes, 4 * total_bytes + 256 * MiB, memory)
    try:
        assert tier.client is not None
        d0 = tier.disk()
        assert tier.daemon is not None
        spill_cpu0, spill_ccpu0 = _cpu_s(tier.daemon.service.pid), time.process_time()
        t0 = time.perf_counter()
        for i in range(0, count, per_save):  # as fast as the daemon takes them
            batch = keys[i:i + per_save]
            tier.client.save(batch, src[:len(batch)])
        saved_s = time.perf_counter() - t0
        d1 = tier.settle()
        spill_s = time.perf_counter() - t0
        spill_daemon_cpu_s = _cpu_s(tier.daemon.service.pid) - spill_cpu0
        spill_client_cpu_s = time.process_time() - spill_ccpu0
        written = d1.bytes_written - d0.bytes_written
        on_disk = d1.disk_bytes_written - d0.disk_bytes_written
        batches = d1.batches_written - d0.batches_written
        pool = tier.report().tenants["(anonymous)"]
        if pool.huge_pages != memory.huge_pages:
            raise RuntimeError(f"the daemon's shared memory: huge pages {pool.huge_pages}, "
                               f"asked {memory.huge_pages}")
        # The objects shared memory no longer holds: all but the last shm's worth.
        evicted = keys[:max(0, count - 2 * (shm_bytes // size))]
        load_evicted_s, evicted_found, limit_evicted = _load_paired(tier, evicted, dst, memory)
        d2 = tier.disk()
        tier.stop()
        t1 = time.perf_counter()
        tier.start()
        # the daemon listens before its disk is recovered: wait for the recovery, so
        # the figures below are the recovery's and the load is a load alone
        d3 = disk_after_recovery(tier.socket_path, 120)
        restart_s = time.perf_counter() - t1
        assert tier.client is not None
        assert tier.daemon is not None
        pid = tier.daemon.service.pid
        cpu0, ccpu0 = _cpu_s(pid), time.process_time()
        load_restart_s, restart_found, limit_restart = _load_paired(tier, keys, dst, memory)
        daemon_cpu_s, client_cpu_s = _cpu_s(pid) - cpu0, time.process_time() - ccpu0
        d4 = tier.disk()
        # The same batch size again from shared memory (the last keys loaded are
        # there): what a load costs without the disk, for the profile.
        tail = keys[-dst.shape[0]:]
        load_shm_s, shm_found = _load_all(tier.client, tail, dst)
        if restart_found == count:  # the last batch's first key, byte for byte
            last = (count - 1) // dst.shape[0] * dst.shape[0]
            if not np.array_equal(dst[0], src[last % per_save]):
                raise RuntimeError(f"{keys[last]} loaded from disk differs from its save")
    finally:
        tier.close()
    return {
        "name": name, "size": size, "count": count, "bytes": count * size,
        "shm_bytes": shm_bytes,
        "spill_gbps": written / spill_s / 1e9, "spill_s": spill_s,
        "spill_records_per_s": written / size / spill_s,
        "spill_daemon_cpu_us_per_record": spill_daemon_cpu_s / count * 1e6,
        "spill_client_cpu_us_per_record": spill_client_cpu_s / count * 1e6,
        "disk_bytes_written": on_disk, "batches_written": batches,
        "header_overhead": 1 - written / on_disk if on_disk else None,
        "client_save_s": saved_s, "save_waits": d1.save_waits - d0.save_waits,
        "unwritten": sum(d1.unwritten.values()) - sum(d0.unwritten.values()),
        "bytes_written": written, "evictions": pool.evictions,
        "evicted_before_write": d1.evicted_before_write,
        "load_evicted_gbps": evicted_found * size / load_evicted_s / 1e9 if evicted else None,
        "load_evicted_objects": len(evicted), "load_evicted_found": evicted_found,
        "load_evicted_disk_hits": d2.tier.hits - d1.tier.hits,
        "restart_s": restart_s, "records_recovered": d3.records_recovered,
        "scan_skipped": d3.scan_skipped,
        "load_restart_gbps": restart_found * size / load_restart_s / 1e9,
        "limit_read_evicted_gbps": limit_evicted, "limit_read_restart_gbps": limit_restart,
        "load_restart_found": restart_found,
        "load_batch_bytes": dst.nbytes,
        "load_shm_gbps": shm_found * size / load_shm_s / 1e9,
        "load_restart_daemon_cpu_s_per_gb": daemon_cpu_s / max(restart_found * size / 1e9,
                                                               1e-9),
        "load_restart_client_cpu_s_per_gb": client_cpu_s / max(restart_found * size / 1e9,
                                                               1e-9),
        "load_restart_disk_hits": d4.tier.hits - d3.tier.hits,
        "direct_io": d4.direct_io, "direct_reads": d4.direct_reads,
        "buffered_reads": d4.buffered_reads,
        "read_latency_p50_ms": (d4.read_latency_p50_s or 0) * 1e3,
        "read_latency_p99_ms": (d4.read_latency_p99_s or 0) * 1e3,
        "write_latency_p50_ms": (d1.write_latency_p50_s or 0) * 1e3,
        "write_latency_p99_ms": (d1.write_latency_p99_s or 0) * 1e3,
    }


# ----------------------------------------------------------------------- the run

def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``--disk*`` options of ``ems bench``."""
    g = ap.add_argument_group("disk tier (--disk)")
    g.add_argument("--disk", action="store_true",
                   help="run the disk-tier bench only (writes bench-disk.json into --out)")
    g.add_argument("--disk-dir", default=None,
                   help="directory on the disk to measure (default: --out); a temp "
                        "directory inside it is removed after")
    g.add_argument("--disk-mib", type=int, default=1024,
                   help="working set per value size, MiB (disk use about 2x this)")
    g.add_argument("--disk-shm-mib", type=int, default=0,
                   help="the daemon's shared memory, MiB (default: a quarter of --disk-mib)")
    g.add_argument("--disk-reps", type=int, default=3,
                   help="repetitions of the limits and the tier's run, interleaved (each "
                        "run against its own limits; the median of the runs)")
    g.add_argument("--disk-huge-pages", choices=HUGE_PAGES, default="auto",
                   help="the daemon's shared memory and the limits' buffers in the "
                        "system's huge pages (vm.nr_hugepages): auto where enough are "
                        "free (default)")
    g.add_argument("--disk-records", type=int, default=1_000_000,
                   help="records of the synthetic checkpoint (recovery)")
    g.add_argument("--disk-scan", type=int, default=100_000,
                   help="records recovered by a scan (no checkpoint)")


class Limits(NamedTuple):
    """The device's ``O_DIRECT`` GB/s for one value size at one moment (fresh files)."""

    write_value: float  # one file, value-size writes
    write_buffer: float  # one file, write-buffer-size writes
    write_regions: float  # write buffers appended to region-size files, one after another
    read_value: float  # one file, value-size reads
    read_chunk: float  # one file, read-chunk-size reads


def _limits(root: Path, size: int, count: int, threads: int, memory: Memory) -> Limits:
    """The device's limits for ``count`` values of ``size`` bytes, ``threads`` deep.
    Deleted files are synced first (this file system discards freed blocks at its
    journal's commit)."""
    os.sync()
    big_write = max(size, WRITE_BUFFER_BYTES)
    big_read = max(size, limit_read_chunk(root, page=memory.page))
    value = device_limit(root, size, count, threads, memory)
    buffer = device_limit(root, big_write, max(threads, count * size // big_write), threads,
                          memory)
    os.sync()
    regions = region_write_limit(root, count * size, REGION_BYTES, big_write, threads,
                                 memory)
    chunk = (value if big_read == size else
             device_limit(root, big_read, max(threads, count * size // big_read), threads,
                          memory))
    return Limits(value[0], buffer[0], regions, value[1], chunk[1])


def case(root: Path, name: str, size: int, count: int, shm: int, threads: int,
         reps: int, memory: Memory = Memory()) -> dict[str, Any]:
    """One value size: ``reps`` repetitions of the device's limits, the tier's run and
    the limits again, each tier figure taken against the limits of its own
    repetition."""
    runs = []
    for _ in range(reps):  # the device's speed drifts: each run has its own limits
        before = _limits(root, size, count, threads, memory)
        run = tier_speed(root, name, size, count * size, shm, memory)
        after = _limits(root, size, count, threads, memory)
        # each way's limit: the mean of right before and right after (the device's
        # speed over the run; the better of two noisy figures would overstate it)
        mean = Limits(*((a + b) / 2 for a, b in zip(before, after)))
        lw = max(mean.write_value, mean.write_buffer, mean.write_regions)
        # a load against the reads of its own region files, batch by batch beside it
        # (fresh files read slower here than the region files: they are in the JSON)
        lr_evicted, lr = run["limit_read_evicted_gbps"], run["limit_read_restart_gbps"]
        run.update(limit_write_gbps=lw, limit_read_gbps=lr,
                   limit_write_value_gbps=mean.write_value,
                   limit_write_buffer_gbps=mean.write_buffer,
                   limit_write_regions_gbps=mean.write_regions,
                   limit_read_value_gbps=mean.read_value,
                   limit_read_chunk_gbps=mean.read_chunk,
                   limits_before=before._asdict(), limits_after=after._asdict(),
                   spill_ratio=run["spill_gbps"] / lw,
                   load_evicted_ratio=(run["load_evicted_gbps"] / lr_evicted
                                       if run["load_evicted_gbps"] and lr_evicted else None),
                   load_restart_ratio=run["load_restart_gbps"] / lr)
        runs.append(run)
    # the figure of each field: its median over the runs (a ratio is the median of the
    # runs' ratios, each against its own run's limit, not a ratio of medians)
    row = dict(runs[reps // 2])
    for key, value in runs[0].items():
        if isinstance(value, float) and all(isinstance(r[key], float) for r in runs):
            row[key] = statistics.median(r[key] for r in runs)
    row.update(reps=reps, write_buffer_bytes=WRITE_BUFFER_BYTES,
               read_chunk_bytes=READ_CHUNK_BYTES,
               limit_read_chunk_bytes=limit_read_chunk(root, page=memory.page), runs=runs,
               store=store_speed(root, size, count, threads))
    return row


def run(root: Path, mib: int, shm_mib: int, records: int, scan_records: int,
        reps: int = 1, say: Callable[[str], None] = print, huge_pages: str = "off"
        ) -> dict[str, Any]:
    """Every measurement in ``root`` (emptied after); the results as a dict.
    ``huge_pages``: ``--disk-huge-pages`` (:func:`choose_memory`)."""
    threads = IO_THREADS
    shm = (shm_mib or max(8, mib // 4)) * MiB
    memory = choose_memory(huge_pages, shm, threads)
    out: dict[str, Any] = {"threads": threads, "mib": mib, "shm_bytes": shm, "align": ALIGN,
                           "reps": reps, "huge_pages": memory.huge_pages, "sizes": []}
    say(f"shared memory and the limits' buffers: "
        f"{'huge pages' if memory.huge_pages else '4 KiB pages'}")
    say(f"{'values':<18}{'limit w':>8}{'spill':>7}{'ratio':>6}{'rec/s':>8}{'head':>6}  "
        f"{'limit r':>8}{'evicted':>8}{'ratio':>6}{'restart':>8}{'ratio':>6}  "
        f"{'store w/r':>10}  (GB/s, {threads} threads, median of {reps})")
    for name, size in SIZES:
        count = max(threads, (mib * MiB) // size)
        row = case(root, name, size, count, shm, threads, reps, memory)
        out["sizes"].append(row)
        store = row["store"]
        ev = row["load_evicted_gbps"] or 0.0
        head = 100 * (row["header_overhead"] or 0.0)
        say(f"{name:<18}{row['limit_write_gbps']:>8.2f}{row['spill_gbps']:>7.2f}"
            f"{row['spill_ratio']:>6.2f}{row['spill_records_per_s']:>8.0f}{head:>5.2f}%  "
            f"{row['limit_read_gbps']:>8.2f}{ev:>8.2f}{(row['load_evicted_ratio'] or 0):>6.2f}"
            f"{row['load_restart_gbps']:>8.2f}{row['load_restart_ratio']:>6.2f}  "
            f"{store['write_gbps']:>4.2f}/{store['read_gbps']:<4.2f}")
    ck = checkpoint_load(root, records)
    say(f"checkpoint load: {ck['records']} records in {ck['load_s']:.2f} s "
        f"({ck['load_s_per_million']:.2f} s per million, CPU "
        f"{ck['load_cpu_s_per_million']:.2f} s; {ck['checkpoint_mib']:.0f} MiB)")
    out["checkpoint"] = ck
    for name, per_save in (("scan", 1), ("scan_batched", 64)):
        sc = scan(root, scan_records, threads, per_save)
        say(f"scan (no checkpoint): {sc['records']} records of 4 KiB, {per_save} a save "
            f"({sc['records_per_batch']:.1f} a batch), in {sc['scan_s']:.2f} s "
            f"({sc['scan_s_per_million']:.1f} s per million, CPU "
            f"{sc['scan_cpu_s_per_million']:.1f} s; {100 * sc['resident_share']:.0f} % of "
            "its files in the page cache)")
        out[name] = sc
    return out


def main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``ems bench --disk``: run, print, write ``OUT/bench-disk.json``."""
    for name in ("disk_mib", "disk_records", "disk_scan", "disk_reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"ems bench: --{name.replace('_', '-')} must be >= 1")
    base = args.disk_dir or args.out
    os.makedirs(base, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    root = Path(tempfile.mkdtemp(dir=base, prefix=".ems-bench-disk-"))
    data = guarded_run(str(root), argv, lambda: run(
        root, args.disk_mib, args.disk_shm_mib, args.disk_records, args.disk_scan,
        args.disk_reps, huge_pages=args.disk_huge_pages))
    if data is None:
        return 130
    path = os.path.join(args.out, "bench-disk.json")
    write_json(path, data)
    print(f"wrote {path} ({data['elapsed_s']:.0f} s)")
    return 0
