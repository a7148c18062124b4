"""The disk store: a synchronous, thread-safe store of values in append-only region
files, one directory per tenant, with an index checkpointed every ``checkpoint_s``.

A pure engine: no event loop, no daemon. The daemon's disk tier calls :meth:`write`,
:meth:`read` and :meth:`checkpoint` from its worker threads (they block on the disk) and
the index queries (:meth:`contains`, :meth:`leading`, :meth:`size_of`) from its event
loop (they take one short lock, never do I/O).

Guarantees:

* ``kill -9`` at any instant never makes a read return wrong bytes: every read checks
  the XXH3-64 of the record's identity (tenant, key, length, the index's sequence
  number) and the bytes that landed against the checksum the index keeps, and says
  ``DAMAGED`` otherwise. Writes are batches (``records.py``: a write buffer's records,
  one ``pwritev``); a key enters the index only once its batch's write returned.
* Every object on disk at the last checkpoint is found after a restart (unless evicted
  since), after a power cut too, by the letter of fsync(2) (the contract, point by
  point, is in ``docs/tiers/disk.md``, "After a power cut"). A checkpoint::

      fdatasync  every region written since the last one (after a scan recovery: every
                 region the scan found records in)
      fsync      every directory whose names changed since: a tenant's on a region
                 created or removed, DIR on a tenant directory made (after a scan
                 recovery: all of them)
      write      index.ckpt.tmp, fsync it
      rename     index.ckpt.tmp -> index.ckpt, fsync DIR      (complete from here)

  Everything a checkpoint names is durable, names included, before its rename is
  issued: a file system that makes the rename durable early keeps the promise too.
  The clean marker is made (file and name) only after the last checkpoint of a
  close is complete.
* A damaged or truncated record is a miss (``DAMAGED``), dropped from the index and
  counted; the store still opens.

Layout (``records.py`` draws a record)::

    DIR/                 0700, flock()ed by the open store
      lock               the lock file
      index.ckpt         the last checkpoint (columnar, checksummed)
      clean              present only between a clean close and the next open
      t<hex(tenant)>/    one directory per tenant: a tenant's reads open only its files
        <region id>.region   records appended up to region_bytes, files 0600

States: ``recovering`` (open() returned, the recovery thread runs) -> ``ok`` -> ``off``
(closed, or the directory vanished / became unwritable: one error line, every call then
returns ``OFF``/False and nothing raises).
"""

from __future__ import annotations

import collections
import enum
import errno
import logging
import mmap
import operator
import os
import threading
import time
from bisect import bisect_right
from itertools import accumulate
from typing import Callable, NamedTuple, Optional, Sequence, Union, cast

from ems.disk.index import DiskIndex, Evicted, Location, Refusal, Reservation, columns
from ems.disk.io import LOCAL, FileSystem, RegionFile, probe_direct, replace_file
from ems.disk.records import (
    ALIGN,
    MAX_NAME_BYTES,
    BatchLayout,
    Checkpoint,
    CheckpointRegion,
    CheckpointTenant,
    checksums,
    encode_batch,
    encode_checkpoint,
    layout,
    round_up,
)
from ems.disk.recovery import CHECKPOINT, CLEAN_MARKER, recover, region_path, tenant_dir
from ems.disk.settings import DiskSettings
from ems.disk.stats import DiskStatistics, LatencyWindow, TenantStatistics

__all__ = ["DiskState", "DiskStore", "DiskStoreLocked", "ReadResult", "WriteResult"]

log = logging.getLogger(__name__)

Clock = Callable[[], float]

#: seconds :meth:`DiskStore.close` waits for writes in flight before its last checkpoint
CLOSE_WAIT_S = 30.0

#: errnos that mean the directory itself is gone or read-only: the store turns off
_FATAL = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ESTALE}


class DiskStoreLocked(RuntimeError):
    """Another disk store (in this or another process) has the directory open."""


class DiskState(enum.Enum):
    RECOVERING = "recovering"
    OK = "ok"
    OFF = "off"


class WriteResult(enum.Enum):
    WRITTEN = "written"
    EXISTS = "exists"  # the key is stored with the same size: nothing written
    NO_SPACE = "no_space"  # the disk (or the filesystem: ENOSPC) is full of busy regions
    QUOTA = "quota"  # the tenant's share is full of busy regions
    BUDGET = "budget"  # the write budget per day is spent
    IO_ERROR = "io_error"
    TOO_LARGE = "too_large"  # larger than a region, the quota or the disk; name too long
    OFF = "off"


class ReadResult(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    DAMAGED = "damaged"  # torn, damaged, truncated or stale record: dropped and counted
    IO_ERROR = "io_error"
    TIMEOUT = "timeout"  # the deadline passed; the buffer may hold part of the value
    OFF = "off"


#: a batch's values, checked at C speed: all memoryviews; each one flat bytes
_VIEW = {memoryview}
_SHAPE = operator.attrgetter("format", "ndim")
_FLAT = {("B", 1)}
_NBYTES = operator.attrgetter("nbytes")


class _Run:
    """Records of one read batch that lie back to back in one region file: read with
    one transfer (``DiskStore.read_batch``)."""

    __slots__ = ("file", "region", "indexes", "locs", "end")

    def __init__(self, file: RegionFile, region: int, indexes: list[int],
                 locs: list[Location]) -> None:
        self.file, self.region, self.indexes, self.locs = file, region, indexes, locs
        self.end = locs[-1].offset + locs[-1].size

    def add(self, index: int, loc: Location) -> None:
        self.indexes.append(index)
        self.locs.append(loc)
        self.end = loc.offset + loc.size


class _Batch(NamedTuple):
    """One write buffer's records, as parallel columns: the indexes of the items they
    came from, keys (and UTF-8), values and their lengths."""

    indexes: list[int]
    keys: list[str]
    kbs: list[bytes]
    views: list[memoryview]
    lens: list[int]

    def without(self, drop: Sequence[bool]) -> _Batch:
        """The records whose ``drop`` is false."""
        keep = [i for i, d in enumerate(drop) if not d]
        return _Batch([self.indexes[i] for i in keep], [self.keys[i] for i in keep],
                      [self.kbs[i] for i in keep], [self.views[i] for i in keep],
                      [self.lens[i] for i in keep])


class _Waiting:
    """A small batch waiting in its tenant's queue to be written (by its own thread
    or by another's, with the batches queued beside it: :meth:`DiskStore.write_batch`)."""

    __slots__ = ("batch", "results", "span", "taken", "done")

    def __init__(self, batch: _Batch, results: list[WriteResult], span: int) -> None:
        self.batch, self.results, self.span = batch, results, span
        self.taken = self.done = False


class _Queue:
    """A tenant's small batches waiting, and how many of its groups are being written
    (at most :data:`GROUP_DEPTH`)."""

    __slots__ = ("waiting", "writing")

    def __init__(self) -> None:
        self.waiting: collections.deque[_Waiting] = collections.deque()
        self.writing = 0  # groups being written


#: a batch whose values take at most this share of a write buffer is written in a group
#: with the small batches of its tenant that wait beside it (see ``write_batch``)
GROUP_SHARE = 4
#: the most turns the head of a queue gives other threads to join its group before it
#: takes it (it stops at the first turn in which none joined: a save alone pays one
#: ``sched_yield``, ~1 us)
GROUP_YIELDS = 64
#: groups of one tenant written at once. The groups come from the turn above, not from
#: this bound: 8 threads saving one 4 KiB record each made 3.4-3.5 records a batch with
#: 1, 3.4-3.8 with 2 and 3.2-3.4 with 8, and the back-pressure replay at +40 ms an I/O
#: (``benchmarks/disk_backpressure.py``) left 0-146 of 55,287 saves unwritten with any
#: of them, as the tree before group commit did (0-131). Two, so that a device whose
#: latency per I/O is long (a network disk) has a tenant's next group on its way
GROUP_DEPTH = 2

_REFUSED = {Refusal.QUOTA: WriteResult.QUOTA, Refusal.NO_SPACE: WriteResult.NO_SPACE,
            Refusal.TOO_LARGE: WriteResult.TOO_LARGE}


#: zeros: the padding between a batch's parts (a view of it is written, never changed)
_ZEROS = memoryview(mmap.mmap(-1, ALIGN))


class _Scratch(threading.local):
    """A page-aligned buffer per thread for a batch's head (O_DIRECT needs aligned
    memory), grown to the largest head so far."""

    def __init__(self) -> None:
        self.block = mmap.mmap(-1, ALIGN)

    def head(self, data: Union[bytes, bytearray], length: int) -> memoryview:
        """``data`` then zeros, ``length`` bytes, in the thread's aligned buffer."""
        if length > len(self.block):
            self.block = mmap.mmap(-1, round_up(length))
        view = memoryview(self.block)[:length]
        view[:len(data)] = data
        view[len(data):] = bytes(length - len(data))
        return view


class DiskStore:
    """See the module docstring. Construct, :meth:`open`, use, :meth:`close`."""

    def __init__(self, settings: DiskSettings, *, clock: Clock = time.monotonic,
                 fs: FileSystem = LOCAL,
                 on_removed: Optional[Callable[[str, Sequence[str]], None]] = None) -> None:
        """``on_removed(tenant, keys)``: told (on the thread that removed them, outside
        the store's lock) of the keys that left the index: their region evicted or lost,
        their record damaged, or deleted (KV events' ``BlockRemoved``)."""
        self.settings = settings
        self._on_removed = on_removed
        self._clock = clock
        self._fs = fs
        self._root = os.path.abspath(settings.path)
        self._lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._recovered = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._state = DiskState.OFF
        self._opened = False
        self._index = DiskIndex(settings.capacity_bytes, settings.region_bytes)
        self._files: dict[int, RegionFile] = {}
        self._dirty: set[int] = set()  # regions written since the last checkpoint
        self._dirty_dirs: set[str] = set()  # directories whose names changed since
        self._next_seq = 1
        self._in_flight = 0
        self._lock_fd = -1
        self._dir_ino = 0
        self._direct = False
        self._threads: list[threading.Thread] = []
        self._scratch = _Scratch()
        self._group = threading.Condition(threading.Lock())
        self._queues: dict[str, _Queue] = {}
        self._tokens = 0.0
        self._tokens_at = clock()
        self._warned_enospc = False
        # statistics
        self._c: collections.Counter[str] = collections.Counter()
        self._write_lat = LatencyWindow()
        self._read_lat = LatencyWindow()
        self._recovery_s = 0.0
        self._scan_skipped = False
        self._last_checkpoint: Optional[float] = None

    # --- lifecycle -------------------------------------------------------------------

    def open(self) -> None:
        """Create and lock the directory, then start recovery in a background thread and
        return at once. Raises :class:`DiskStoreLocked` when another store has it; a
        directory that cannot be created leaves the store ``off`` (one error line)."""
        if self._opened:
            raise RuntimeError("DiskStore.open() called twice")
        self._opened = True
        try:
            self._make_root()
            self._fs.make_private(self._root)
            fd = self._fs.lock(os.path.join(self._root, "lock"))
        except BlockingIOError:
            raise DiskStoreLocked(f"{self._root} is already open by another disk store "
                                  "(one store per directory)") from None
        except OSError as exc:
            self._turn_off(f"cannot open {self._root}: {exc}")
            self._recovered.set()
            return
        self._lock_fd = fd
        try:
            clean = self._prepare()
        except OSError as exc:
            self._turn_off(f"cannot use {self._root}: {exc}")
            self._recovered.set()
            return
        self._state = DiskState.RECOVERING
        t = threading.Thread(target=self._recover, args=(clean,), name="ems-disk-recovery",
                             daemon=True)
        self._threads.append(t)
        t.start()

    def _prepare(self) -> bool:
        """Probe the directory (O_DIRECT, size) and take away the clean-shutdown marker
        (before the first new write: a crash from now on scans); True if it was there."""
        self._dir_ino = self._fs.dir_id(self._root)
        self._direct = probe_direct(self._fs, self._root)
        total = self._fs.total_bytes(self._root)
        if self.settings.capacity_bytes > total:
            log.warning("disk store %s: capacity %d bytes is larger than the filesystem "
                        "(%d bytes); a full filesystem stops admission (ENOSPC)", self._root,
                        self.settings.capacity_bytes, total)
        if self.settings.write_budget_bytes_per_day is not None:
            self._tokens = self._burst()
        clean = self._fs.exists(os.path.join(self._root, CLEAN_MARKER))
        if clean:
            self._fs.unlink(os.path.join(self._root, CLEAN_MARKER))
            self._fs.sync_dir(self._root)
        return clean

    def _make_root(self) -> None:
        """The store's directory and any missing parents (``mkdir -p``)."""
        missing = []
        at = self._root
        while not self._fs.exists(at):
            missing.append(at)
            parent = os.path.dirname(at)
            if parent == at:
                break
            at = parent
        for path in reversed(missing):
            if self._fs.make_dir(path):
                self._fs.sync_dir(os.path.dirname(path))

    def _recover(self, clean: bool) -> None:
        t0 = time.monotonic()
        try:
            got = recover(self._root, self.settings.capacity_bytes, self.settings.region_bytes,
                          clean, self._fs)
        except OSError as exc:
            self._turn_off(f"recovery of {self._root} failed: {exc}")
            self._recovered.set()
            return
        with self._lock:
            if self._state is DiskState.RECOVERING:
                self._index = got.index
                self._next_seq = got.next_seq
                if not got.scan_skipped or got.stale_regions_removed:
                    # after a crash (kill -9 keeps the page cache) what the scan found
                    # may not be durable, nor may the names of its files, nor the
                    # removals of stale regions: the first checkpoint makes them so
                    # before it names them
                    self._dirty |= got.scanned_regions
                    self._dirty_dirs.add(self._root)
                    self._dirty_dirs |= {tenant_dir(self._root, t)
                                         for t, _r, _at in got.index.scan_from()}
                self._c["records_recovered"] = got.records_recovered
                self._c["records_dropped_damaged"] += got.records_dropped_damaged
                self._c["records_scanned"] = got.records_scanned
                self._scan_skipped = got.scan_skipped
                self._recovery_s = time.monotonic() - t0
                self._state = DiskState.OK
        self._recovered.set()
        log.info("disk store %s: %d records recovered in %.3f s (%s)", self._root,
                 got.records_recovered, self._recovery_s,
                 "clean shutdown, scan skipped" if got.scan_skipped else
                 f"{got.records_scanned} records scanned")
        if self.settings.checkpoint_s > 0 and self._state is DiskState.OK:
            t = threading.Thread(target=self._timer, name="ems-disk-checkpoint", daemon=True)
            self._threads.append(t)
            t.start()

    def _timer(self) -> None:
        while not self._stop.wait(self.settings.checkpoint_s):
            self.checkpoint()

    def wait_recovered(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for recovery; True once it is over (or the store off)."""
        return self._recovered.wait(max(0.0, timeout_s))

    @property
    def recovering(self) -> bool:
        return self._state is DiskState.RECOVERING

    @property
    def state(self) -> DiskState:
        return self._state

    @property
    def scan_skipped(self) -> bool:
        """Whether the last recovery skipped the scan (a clean shutdown before it)."""
        return self._scan_skipped

    def close(self, clean: bool = True) -> None:
        """Stop the checkpoint timer, wait (up to :data:`CLOSE_WAIT_S`) for writes in
        flight, take a final checkpoint and, if ``clean`` and no write is still in
        flight, leave the marker that lets the next open skip the scan. Idempotent."""
        self._stop.set()
        self._recovered.wait(60.0)
        ok = self._state is DiskState.OK
        if ok:
            with self._lock:
                self._state = DiskState.OFF  # no new writes or reads from now on
                end = time.monotonic() + CLOSE_WAIT_S
                while self._in_flight and time.monotonic() < end:
                    self._idle.wait(end - time.monotonic())
                busy = self._in_flight
            ok = self._checkpoint(final=True)
            if ok and clean and busy:
                # the marker would vouch for a checkpoint that misses these records
                log.warning("disk store %s: %d write(s) still in flight at close; no "
                            "clean-shutdown marker (the next open scans)", self._root, busy)
            elif ok and clean:
                try:
                    marker = self._fs.open_file(os.path.join(self._root, CLEAN_MARKER),
                                                create=True)
                    try:
                        self._fs.sync_file(marker)
                    finally:
                        self._fs.close(marker)
                    self._fs.sync_dir(self._root)
                except OSError as exc:
                    log.warning("disk store %s: no clean-shutdown marker: %s", self._root, exc)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5.0)
        with self._lock:
            self._state = DiskState.OFF
            for f in self._files.values():
                if f.users == 0:
                    f.close()
            self._files.clear()
            if self._lock_fd >= 0:
                self._fs.close(self._lock_fd)
                self._lock_fd = -1

    def _turn_off(self, why: str) -> None:
        with self._lock:
            if self._state is DiskState.OFF and self._c["turned_off"]:
                return
            first = not self._c["turned_off"]
            self._c["turned_off"] += 1
            self._state = DiskState.OFF
        self._stop.set()
        if first:
            log.error("disk store %s turned off: %s", self._root, why)

    def _alive(self) -> bool:
        """Whether the directory is still the one opened (removed => off)."""
        try:
            if self._fs.dir_id(self._root) == self._dir_ino:
                return True
            why = "the directory was replaced"
        except OSError as exc:
            why = f"the directory is gone: {exc}"
        self._turn_off(why)
        return False

    # --- queries (index only, no I/O) ------------------------------------------------
    # While recovery runs they answer False / 0 / None: a caller that must not miss an
    # object only because recovery has not reached it waits with wait_recovered(...)
    # bounded by its own deadline first.

    def contains(self, tenant: str, key: str, size: Optional[int] = None) -> bool:
        """Whether the index has ``key`` (of ``size`` bytes when given)."""
        return bool(self.leading(tenant, [key], None if size is None else [size]))

    def leading(self, tenant: str, keys: Sequence[str],
                sizes: Optional[Sequence[int]] = None) -> list[int]:
        """The sizes of the leading run of ``keys`` the index has (with those
        ``sizes``, when given), under one hold of the lock: a disk tier's lookup."""
        run: list[int] = []
        if self._state is not DiskState.OK:
            return run
        size_of = self._index.size_of
        with self._lock:
            for i, key in enumerate(keys):
                got = size_of(tenant, key)
                if got is None or (sizes is not None and got != sizes[i]):
                    break
                run.append(got)
        return run

    def keys(self) -> dict[str, list[str]]:
        """tenant -> the keys the index holds (a snapshot)."""
        with self._lock:
            return {t: self._index.keys(t) for t in self._index.tenants()}

    # --- writes ----------------------------------------------------------------------

    def write(self, tenant: str, key: str, value: Union[memoryview, bytes, bytearray]
              ) -> WriteResult:
        """:meth:`write_batch` of one value (a batch of one: a one-block head)."""
        return self.write_batch(tenant, [key], [value])[0]

    def write_batch(self, tenant: str, keys: Sequence[str],
                    values: Sequence[Union[memoryview, bytes, bytearray]]
                    ) -> list[WriteResult]:
        """Append records holding each key's value (blocking), packed into batches of
        at most ``write_buffer_bytes``, each one ``pwritev`` gathered from the values
        where they lie (no copy); a key is in the index once its batch's write returned
        (its bytes are in the file: durable at the next checkpoint), never before, so a
        read never sees a record still being written. Never raises for a disk
        condition. Waits for recovery first (it must know the sequence numbers). A key
        given twice is written once (the first; ``EXISTS`` after), and so is a key the
        index holds with a value of that size already (``EXISTS``).

        Per record this is a few steps of Python (a key encoded once, a checksum, a
        head entry, an index entry, each in one comprehension or call over the batch's
        columns; duplicates, long names and values that are not flat bytes are looked
        for per record only when the batch has some): the daemon's writers share its
        interpreter lock with its loop, and what a save of small blocks spills per
        second is bounded by it (``ems bench --disk``, 16 KiB values)."""
        results = [WriteResult.OFF] * len(keys)
        if not self._opened or not keys:
            return results
        if len(values) != len(keys):
            raise ValueError(f"write_batch: {len(keys)} keys, {len(values)} values")
        self._recovered.wait()
        t0 = self._clock()
        tb = tenant.encode()
        room = MAX_NAME_BYTES - len(tb)
        keys = list(keys)
        kbs = [key.encode() for key in keys]
        views: list[memoryview] = (
            cast(list[memoryview], list(values)) if set(map(type, values)) == _VIEW else
            [v if type(v) is memoryview else memoryview(v) for v in values])
        if set(map(_SHAPE, views)) != _FLAT:  # (rare) a view of other items or shape
            views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        indexes = list(range(len(keys)))
        if len(set(keys)) < len(keys) or max(map(len, kbs)) > room:  # (rare) the refusals
            keep = []
            seen: set[str] = set()
            for i, (key, kb) in enumerate(zip(keys, kbs)):
                if len(kb) > room:
                    results[i] = self._refuse(WriteResult.TOO_LARGE)
                elif key in seen:
                    results[i] = WriteResult.EXISTS
                else:
                    seen.add(key)
                    keep.append(i)
            indexes = keep
            keys = [keys[i] for i in keep]
            kbs = [kbs[i] for i in keep]
            views = [views[i] for i in keep]
        lens = list(map(_NBYTES, views))
        if not indexes or self._state is not DiskState.OK or not self._alive():
            return results
        cap = self.settings.write_buffer_bytes
        ends = list(accumulate(-(-n // ALIGN) * ALIGN for n in lens))  # (blocks' ends)
        total = ends[-1]
        if total <= cap // GROUP_SHARE:
            self._write_grouped(tenant, tb, _Waiting(_Batch(indexes, keys, kbs, views, lens),
                                                     results, total))
        else:  # cut into write buffers: as many values as fit, one at least
            start = base = 0
            while start < len(ends):
                j = max(start + 1, bisect_right(ends, base + cap, start))
                self._write_one_batch(tenant, tb, _Batch(
                    indexes[start:j], keys[start:j], kbs[start:j], views[start:j],
                    lens[start:j]), results)
                start, base = j, ends[j - 1]
        if WriteResult.WRITTEN in results:
            self._write_lat.add(self._clock() - t0)
        return results

    def _write_grouped(self, tenant: str, tb: bytes, mine: _Waiting) -> None:
        """Group commit (a database log's, LevelDB's writer queue): a small batch joins
        its tenant's queue; the batch at the head of the queue, when fewer than
        :data:`GROUP_DEPTH` of the tenant's groups are being written, takes the
        batches behind it (up to a write buffer) and writes them as one batch, one
        head, one ``pwritev``; the others wait for it and return its results as
        theirs::

            queued --head of the queue, < GROUP_DEPTH writing--> leader --written--> done
               |                                                                    ^
               +--------taken into the leader's group (taken: out of the queue)-----+

        A save alone is written at once (after one turn). Saves that arrive together (the
        daemon's writers, engines saving a block at a time) share heads: a scan
        parses one head per group instead of one per save (~3 us a head of one
        record on the 2-vCPU VM, a third of the scan's cost per record), and a
        spill of small saves makes one system call per group.

        The head gives the threads that are ready to run a turn (``sched_yield``, the
        GIL released) before it takes its group, as long as each turn brings one more:
        8 threads saving one 4 KiB record each (``ems bench --disk``'s scan) wrote
        groups of ~1.4 records without it (a thread joins only while the GIL is free,
        during another's ``pwritev``), ~3-5 with it; ``time.sleep(0)`` instead made
        groups of ~5.6 but costs ~100 us on this VM's kernel, where ``sched_yield``
        costs ~1 us (PostgreSQL's ``commit_delay`` waits a fixed time instead).

        A key in two batches of a group is written once, for the first; the other
        gets ``EXISTS`` when that write succeeded, its result otherwise."""
        cap = self.settings.write_buffer_bytes
        with self._group:
            q = self._queues.get(tenant)
            if q is None:
                q = self._queues[tenant] = _Queue()
            q.waiting.append(mine)
            while not mine.done and (mine.taken or q.writing >= GROUP_DEPTH
                                     or q.waiting[0] is not mine):
                self._group.wait()
            if mine.done:
                return
            mine.taken = True
            for _ in range(GROUP_YIELDS):  # let the writers that are ready join first
                n = len(q.waiting)
                self._group.release()
                try:
                    os.sched_yield()
                finally:
                    self._group.acquire()
                if len(q.waiting) == n:
                    break
            group = [q.waiting.popleft()]
            filled = mine.span
            while q.waiting and filled + q.waiting[0].span <= cap:
                filled += q.waiting[0].span
                w = q.waiting.popleft()
                w.taken = True
                group.append(w)
            q.writing += 1
        try:
            if len(group) == 1:
                self._write_one_batch(tenant, tb, mine.batch, mine.results)
            else:
                self._write_group(tenant, tb, group)
        finally:
            with self._group:
                q.writing -= 1
                for w in group:
                    w.done = True
                if not q.waiting and not q.writing and self._queues.get(tenant) is q:
                    del self._queues[tenant]
                self._group.notify_all()

    def _write_group(self, tenant: str, tb: bytes, group: Sequence[_Waiting]) -> None:
        """The batches of ``group`` written as one (each one's results set)."""
        keys: list[str] = []
        kbs: list[bytes] = []
        views: list[memoryview] = []
        lens: list[int] = []
        first: dict[str, int] = {}  # key -> its position in the merged batch
        where: list[list[int]] = []  # per batch, per record: its key's position
        for w in group:
            b = w.batch
            at = []
            for key, kb, view, n in zip(b.keys, b.kbs, b.views, b.lens):
                j = first.get(key)
                if j is None:
                    j = first[key] = len(keys)
                    keys.append(key)
                    kbs.append(kb)
                    views.append(view)
                    lens.append(n)
                at.append(j)
            where.append(at)
        merged = [WriteResult.OFF] * len(keys)
        self._write_one_batch(tenant, tb, _Batch(list(range(len(keys))), keys, kbs, views,
                                                 lens), merged)
        owner = [True] * len(keys)  # the first record of a key takes its result
        for w, at in zip(group, where):
            for i, j in zip(w.batch.indexes, at):
                r = merged[j]
                if owner[j]:
                    owner[j] = False
                elif r is WriteResult.WRITTEN:
                    r = WriteResult.EXISTS
                w.results[i] = r

    def _write_one_batch(self, tenant: str, tb: bytes, batch: _Batch,
                         results: list[WriteResult]) -> None:
        """Reserve, write and commit one batch (its ``indexes`` into ``results``, which
        it sets)."""
        with self._lock:
            if self._state is not DiskState.OK:
                return
            held = self._index.held(tenant, batch.keys, batch.lens)
            if held is not None and any(held):
                for i, h in zip(batch.indexes, held):
                    if h:
                        results[i] = WriteResult.EXISTS
                batch = batch.without(held)
                if not batch.indexes:
                    return
            shape = layout(tb, batch.kbs, batch.lens)
            if not self._take_budget(shape.span):
                self._c["refused_budget"] += len(batch.indexes)
                for i in batch.indexes:
                    results[i] = WriteResult.BUDGET
                return
            res = self._index.reserve(tenant, shape.span)
            if isinstance(res, Refusal):
                self._c["refused_" + res.value] += len(batch.indexes)
                for i in batch.indexes:
                    results[i] = _REFUSED[res]
                return
            first_seq = self._next_seq
            self._next_seq += len(batch.indexes)
            self._in_flight += 1
            gone = self._forget_files(res.evicted)
            failed: Optional[OSError] = None
            try:
                f: Optional[RegionFile] = self._file(res.region, res.tenant, create=res.fresh)
            except OSError as exc:
                f, failed = None, exc
        try:
            self._delete_files(gone)
            self._removed(res.evicted)
            if f is None:
                assert failed is not None
                result = self._write_failed(res, failed)
            else:
                result = self._write_records(f, res, tb, shape, first_seq, batch)
            for i in batch.indexes:
                results[i] = result
        finally:
            with self._lock:
                self._in_flight -= 1
                self._idle.notify_all()

    def _write_records(self, f: RegionFile, res: Reservation, tb: bytes, shape: BatchLayout,
                       first_seq: int, batch: _Batch) -> WriteResult:
        """One batch: its head, then each value at its offset in ``shape``, zeros
        between and up to its span (none when every length is a multiple of ALIGN: then
        it goes O_DIRECT), in one ``pwritev``; then every record enters the index at
        once."""
        offsets, span = shape.offsets, shape.span
        seqs = range(first_seq, first_seq + len(batch.indexes))
        try:
            head, sums = encode_batch(tb, batch.kbs, first_seq, batch.views, list(offsets),
                                      span)
            parts = [self._scratch.head(head, offsets[0])]
            if shape.packed:  # (whole blocks: the values back to back)
                parts += batch.views
                at = offsets[-1] + batch.lens[-1]
            else:
                at = offsets[0]
                for view, off, n in zip(batch.views, offsets, batch.lens):
                    if off > at:
                        parts.append(_ZEROS[:off - at])
                    parts.append(view)
                    at = off + n
            if span > at:
                parts.append(_ZEROS[:span - at])
            direct = f.write(parts, res.offset)
        except OSError as exc:
            return self._write_failed(res, exc)
        finally:
            self._release(f)
        base = res.offset
        with self._lock:
            self._index.commit_batch(res, batch.keys, batch.lens, seqs,
                                     [base + off for off in offsets], sums)
            self._dirty.add(res.region)
            c = self._c
            c["bytes_written"] += sum(batch.lens)
            c["writes"] += len(batch.indexes)
            c["batches_written"] += 1
            c["bytes_written_disk"] += span
            c["direct_writes" if direct else "buffered_writes"] += 1
        return WriteResult.WRITTEN

    def _write_failed(self, res: Reservation, exc: OSError) -> WriteResult:
        with self._lock:
            self._index.abort(res)
            if exc.errno == errno.ENOSPC:
                # the filesystem is smaller than the capacity: stop growing at what is
                # there; later writes reclaim the least recently used regions instead
                self._index.capacity_bytes = max(0, self._index.used_bytes - res.span)
                self._c["refused_no_space"] += 1
                warn = not self._warned_enospc
                self._warned_enospc = True
            elif exc.errno in _FATAL:
                warn = False
            else:
                self._c["refused_io_error"] += 1
                log.warning("disk store %s: write failed: %s", self._root, exc)
                return WriteResult.IO_ERROR
        if exc.errno == errno.ENOSPC:
            if warn:
                log.warning("disk store %s: the filesystem is full (ENOSPC) at %d bytes; "
                            "admission now stays within them", self._root,
                            self._index.capacity_bytes)
            return WriteResult.NO_SPACE
        self._turn_off(f"write failed: {exc}")
        return WriteResult.OFF

    def _refuse(self, result: WriteResult) -> WriteResult:
        with self._lock:
            self._c["refused_" + result.value] += 1
        return result

    def _burst(self) -> float:
        # an hour's share of the day's budget may be spent at once
        budget = self.settings.write_budget_bytes_per_day or 0
        return budget / 24.0

    def _take_budget(self, span: int) -> bool:
        budget = self.settings.write_budget_bytes_per_day
        if budget is None:
            return True
        now = self._clock()
        self._tokens = min(self._burst(), self._tokens + (now - self._tokens_at) * budget / 86400)
        self._tokens_at = now
        if self._tokens < span:
            return False
        self._tokens -= span
        return True

    def delete(self, tenant: str, key: str) -> None:
        """Forget ``key``; its bytes go with its region."""
        if self._state is not DiskState.OK:
            return
        with self._lock:
            gone = self._index.remove(tenant, key)
        if gone is not None and self._on_removed is not None:
            self._on_removed(tenant, [key])

    def set_quota(self, tenant: str, quota_bytes: Optional[int]) -> None:
        """Bound ``tenant``'s disk bytes (None: only the capacity bounds them); a tenant
        over its quota gives up its least recently used regions at its next write."""
        with self._lock:
            self._index.set_quota(tenant, quota_bytes)

    # --- reads -----------------------------------------------------------------------

    def read(self, tenant: str, key: str, into: memoryview, deadline: float) -> ReadResult:
        """Read ``key``'s value into ``into`` (exactly its size) by ``deadline`` (on the
        store's clock): no transfer starts after it. ``HIT`` only when the checksum the
        index keeps (tenant, key, seq, length and value) holds for the bytes read."""
        return self.read_batch(tenant, [(key, into)], deadline)[0]

    def read_batch(self, tenant: str, targets: Sequence[tuple[str, memoryview]],
                   deadline: float) -> list[ReadResult]:
        """:meth:`read` of each ``(key, into)``, by ``deadline``. Records that lie back to
        back in one region file (a save's blocks: one write buffer) are read with one
        transfer, a ``preadv`` of their buffers (O_DIRECT when they and the offset
        allow), and each is then checked against its own checksum: a damaged one is
        dropped alone. Why: every I/O costs this VM's kernel ~50 us of CPU beside the
        copy (``benchmarks/disk_store.py``), which a run of 256 KiB blocks now pays
        once instead of once a block."""
        n = len(targets)
        if not self._opened:
            return [ReadResult.OFF] * n
        counts: collections.Counter[str] = collections.Counter()
        if self._state is DiskState.RECOVERING:
            if not self._recovered.wait(max(0.0, deadline - self._clock())):
                with self._lock:
                    self._c["read_timeout"] += n
                return [ReadResult.TIMEOUT] * n
        if self._state is not DiskState.OK or not self._alive():
            return [ReadResult.OFF] * n
        t0 = self._clock()
        results: list[ReadResult] = [ReadResult.MISS] * n
        runs: list[_Run] = []
        lost: list[Optional[Evicted]] = []
        with self._lock:
            locs = [self._index.lookup(tenant, key) for key, _ in targets]
            for (key, into), loc in zip(targets, locs):
                if loc is not None and into.nbytes != loc.size:
                    raise ValueError(f"read into {into.nbytes} bytes, {key!r} has {loc.size}")
            run: Optional[_Run] = None
            for i, loc in enumerate(locs):
                if loc is None:
                    counts["misses"] += 1
                    run = None
                    continue
                if run is not None and run.region == loc.region and run.end == loc.offset:
                    run.add(i, loc)
                    continue
                run = None
                try:
                    f = self._file(loc.region, tenant, create=False)
                except FileNotFoundError:
                    gone = self._index.drop_region(loc.region)
                    self._forget_files((gone,))
                    lost.append(gone)
                    counts["records_dropped_damaged"] += 1
                    counts["read_damaged"] += 1
                    results[i] = ReadResult.DAMAGED
                    continue
                except OSError:
                    counts["read_io_error"] += 1
                    results[i] = ReadResult.IO_ERROR
                    continue
                self._index.touch(loc.region)
                run = _Run(f, loc.region, [i], [loc])
                runs.append(run)
            self._c.update(counts)
        if lost:
            self._removed(lost)
        for run in runs:
            self._read_run(tenant, run, targets, results, deadline, t0)
        return results

    def _read_run(self, tenant: str, run: _Run, targets: Sequence[tuple[str, memoryview]],
                  results: list[ReadResult], deadline: float, t0: float) -> None:
        """One run's values in one transfer, then each checksum against the index's: the
        record's identity (tenant, key, seq, length) is in it, so a stale or torn record
        fails it, and a short read (the file ends early) fails the records it cut."""
        views = [targets[i][1] for i in run.indexes]
        outcome = ReadResult.TIMEOUT  # when nothing comes back
        try:
            got = run.file.read(views, run.locs[0].offset, deadline, self._clock)
        except EOFError:
            got = False  # (the checksums tell which records it cut)
        except OSError as exc:
            log.debug("disk store %s: read failed: %s", self._root, exc)
            got, outcome = None, ReadResult.IO_ERROR
        finally:
            self._release(run.file)
        counts: collections.Counter[str] = collections.Counter()
        if got is None:  # the deadline passed (or an error): nothing of the run is read
            for i in run.indexes:
                results[i] = outcome
            counts["read_" + outcome.value] += len(run.indexes)
            with self._lock:
                self._c.update(counts)
            return
        tb = tenant.encode()
        sums = checksums(tb, [targets[i][0].encode() for i in run.indexes],  # (not locked)
                         [loc.seq for loc in run.locs], views)
        good = [s == loc.checksum for s, loc in zip(sums, run.locs)]
        damaged: list[str] = []
        with self._lock:
            for i, loc, ok in zip(run.indexes, run.locs, good):
                key = targets[i][0]
                if ok:
                    results[i] = ReadResult.HIT
                    counts["hits"] += 1
                    counts["bytes_read"] += loc.size
                    counts["direct_reads" if got else "buffered_reads"] += 1
                    continue
                results[i] = ReadResult.DAMAGED
                counts["read_damaged"] += 1
                if self._index.remove(tenant, key, seq=loc.seq) is not None:
                    counts["records_dropped_damaged"] += 1
                    damaged.append(key)
            self._c.update(counts)
        if counts["hits"]:
            self._read_lat.add(self._clock() - t0)
        if damaged and self._on_removed is not None:
            self._on_removed(tenant, damaged)

    # --- region files ----------------------------------------------------------------

    def _file(self, region: int, tenant: str, *, create: bool) -> RegionFile:
        """The region's open file, one more user (the caller holds the lock or not)."""
        f = self._files.get(region)
        if f is None:
            if create and self._fs.make_dir(tenant_dir(self._root, tenant)):
                self._dirty_dirs.add(self._root)
            f = RegionFile(self._fs, region_path(self._root, tenant, region), create=create,
                           direct=self._direct, chunk_bytes=self.settings.chunk_bytes,
                           io_delay_s=self.settings.io_delay_s)
            self._files[region] = f
            if create:
                self._dirty_dirs.add(tenant_dir(self._root, tenant))
        f.users += 1
        return f

    def _release(self, f: RegionFile) -> None:
        with self._lock:
            f.users -= 1
            if f.dead and f.users == 0:
                f.close()

    def _forget_files(self, evicted: Sequence[Optional[Evicted]]) -> list[str]:
        """Under the lock: the evicted regions' files leave the table (closed once their
        last user is done); returns the paths to delete."""
        paths = []
        for e in evicted:
            if e is None:
                continue
            f = self._files.pop(e.region, None)
            if f is not None:
                f.dead = True
                if f.users == 0:
                    f.close()
            self._dirty.discard(e.region)
            paths.append(region_path(self._root, e.tenant, e.region))
            self._c["regions_evicted"] += 1
        return paths

    def _removed(self, evicted: Sequence[Optional[Evicted]]) -> None:
        """Outside the lock: tell ``on_removed`` the keys that went with ``evicted``."""
        if self._on_removed is None:
            return
        for e in evicted:
            if e is not None and e.keys:
                self._on_removed(e.tenant, e.keys)

    def _delete_files(self, paths: list[str]) -> None:
        """Remove evicted regions' files; the next checkpoint syncs their directories
        (marked after the unlink: a checkpoint that syncs the directory earlier would
        not make this removal durable)."""
        for p in paths:
            try:
                self._fs.unlink(p)
            except FileNotFoundError:
                continue
            with self._lock:
                self._dirty_dirs.add(os.path.dirname(p))

    # --- checkpoints -----------------------------------------------------------------

    def checkpoint(self) -> None:
        """Make every object stored so far survive a crash (see the module docstring)."""
        if self._state is DiskState.OK:
            self._checkpoint(final=False)

    def _checkpoint(self, final: bool) -> bool:
        with self._checkpoint_lock:
            with self._lock:
                if not final and self._state is not DiskState.OK:
                    return False
                files, failed = self._dirty_files()
                dirty, self._dirty = self._dirty, set()
                dirs, self._dirty_dirs = self._dirty_dirs, set()
                regions = [CheckpointRegion(t, r, at) for t, r, at in self._index.scan_from()]
                snap = {t: self._index.entries(t) for t in self._index.tenants()}
                next_seq = self._next_seq
                next_region = self._index.next_region
            try:
                if failed is not None:
                    raise failed
                for f in files:
                    f.fdatasync()
                # tenant directories before the root: any order is correct (both come
                # before the rename), this one reads as the tree is built
                for d in sorted(dirs, key=len, reverse=True):
                    self._fs.sync_dir(d)
            except OSError as exc:
                with self._lock:
                    self._dirty |= dirty
                    self._dirty_dirs |= dirs
                self._turn_off(f"checkpoint failed: {exc}")
                return False
            finally:
                for f in files:
                    self._release(f)
            tenants = [CheckpointTenant(t, *columns(entries)) for t, entries in snap.items()]
            data = encode_checkpoint(Checkpoint(next_seq, next_region, regions, tenants))
            path = os.path.join(self._root, CHECKPOINT)
            try:
                replace_file(self._fs, path, data)
            except OSError as exc:
                self._turn_off(f"checkpoint failed: {exc}")
                return False
            with self._lock:
                self._c["checkpoints"] += 1
                self._last_checkpoint = self._clock()
            return True

    def _dirty_files(self) -> tuple[list[RegionFile], Optional[OSError]]:
        """Under the lock: the open files of the regions written since the last
        checkpoint, one more user each (a region recovered by a scan is opened here);
        the error that kept one from opening, if any."""
        files = []
        for r in self._dirty:
            tenant = self._index.region_tenant(r)
            if tenant is None:
                continue
            try:
                files.append(self._file(r, tenant, create=False))
            except FileNotFoundError:  # gone: its entries are misses, nothing to sync
                continue
            except OSError as exc:
                return files, exc
        return files, None

    # --- statistics ------------------------------------------------------------------

    def statistics(self) -> DiskStatistics:
        with self._lock:
            c = self._c
            idx = self._index
            tenants = tuple(TenantStatistics(t, idx.objects(t), idx.value_bytes(t),
                                             idx.tenant_bytes(t), idx.quota(t))
                            for t in idx.tenants())
            age = (None if self._last_checkpoint is None
                   else self._clock() - self._last_checkpoint)
            return DiskStatistics(
                state=self._state.value, capacity_bytes=self.settings.capacity_bytes,
                used_bytes=idx.used_bytes, objects=idx.objects(), regions=idx.regions(),
                tenants=tenants, writes=c["writes"], bytes_written=c["bytes_written"],
                reads=c["hits"] + c["misses"] + sum(c["read_" + r.value] for r in ReadResult
                                                     if r not in (ReadResult.HIT,
                                                                  ReadResult.MISS)),
                hits=c["hits"], misses=c["misses"], bytes_read=c["bytes_read"],
                read_damaged=c["read_damaged"], read_io_errors=c["read_io_error"],
                read_timeouts=c["read_timeout"],
                write_latency_p50_s=self._write_lat.quantile(0.5),
                write_latency_p99_s=self._write_lat.quantile(0.99),
                read_latency_p50_s=self._read_lat.quantile(0.5),
                read_latency_p99_s=self._read_lat.quantile(0.99),
                refused_no_space=c["refused_no_space"], refused_quota=c["refused_quota"],
                refused_budget=c["refused_budget"], refused_io_error=c["refused_io_error"],
                refused_too_large=c["refused_too_large"],
                regions_evicted=c["regions_evicted"],
                records_recovered=c["records_recovered"],
                records_scanned=c["records_scanned"],
                records_dropped_damaged=c["records_dropped_damaged"],
                recovery_s=self._recovery_s, scan_skipped=self._scan_skipped,
                checkpoints=c["checkpoints"], last_checkpoint_age_s=age,
                direct_io=self._direct, direct_writes=c["direct_writes"],
                buffered_writes=c["buffered_writes"], direct_reads=c["direct_reads"],
                buffered_reads=c["buffered_reads"], batches_written=c["batches_written"],
                disk_bytes_written=c["bytes_written_disk"])

