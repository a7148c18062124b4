"""The tier driver: the books of a tier beyond shared memory, kept once.

A tier beyond shared memory (the local disk, ``ems.server.disk_tier``; the Valkey
Cluster, ``ems.server.cluster_tier``) is an :class:`Engine`: it looks keys up, reads a
value into memory it is given, writes a value from memory it is given, and reports.
Everything around that is the same for every engine and is written here once
(vLLM's ``v1/kv_offload`` splits it so: the manager keeps placement and pins, the
handler only moves bytes; CacheLib's Navy puts each engine behind one interface with
admission as a policy class). :class:`TierDriver` implements the request handlers'
tier seam (``ems.server.tiers.Tier``) for one engine and owns:

* **executors**: readers and writers apart, so a load never waits for a worker held by
  a write-out to a slow disk or a hung node;
* **deadlines**: a request's deadline, capped by ``max_op_s`` (a fetch writes into a
  reservation, which must not expire under it: at most half the reservation TTL),
  kept by the daemon's loop (:meth:`Loop.call_at`), not by a thread of its own, on the
  clock the driver is given (the daemon's; a test's ``ems.testing.clock.FakeClock``);
  the engine, on its threads, gets the same time left in ``time.monotonic``;
* **fetches** into shared memory: planning and de-duplication, commit and abort
  (``ems.server.fetches.FetchBook``), transfers still running at the deadline;
* **write-out**: admission (:class:`Admission`, a small policy), the bytes waiting
  (``queue_bytes``; past it a save is not written there, counted as ``dropped``), the
  values pinned in shared memory while written, bounded in all (``inflight_bytes``)
  and per tenant (``tenant_share`` of its pool: a slow engine never makes shared
  memory refuse saves), a flush of what the engine lacks at stop;
* **counters** in all and per tenant, one rate-limited warning per reason, the
  latency of the engine's calls.

A fetch, step by step (the loop owns the book; the engine runs on a reader)::

    loop:    lookup (the engine's index, no I/O) -> the leading run it holds
             plan: a key another request fetches now -> wait for that fetch;
                   else reserve it (NEW) -> this request's fetch; else the run ends
    reader:  read into the reserved memory (a contiguous share of the keys on each
             reader, or the whole fetch in one batch: ``Engine.parallel_reads``)
    loop:    the last read returned, or the deadline (call_at), whichever first:
             commit the whole ones, abort the others, wake every waiter; a read
             still running then keeps its reservation and is aborted when it
             returns, so its bytes are never shown to anyone

A write-out, step by step::

    loop:    admitted? -> fits in flight now (and nothing waits)? -> start
             else room in the queue? -> wait there, marked unwritten in the pool
             (evicted only after every written object); else dropped (counted, warned)
    start:   pin the save's objects still in shared memory (gone? counted) -> writer
    writer:  held by the engine already? -> HELD (its one check, under its lock);
             else write from the pinned memory (no copy beyond the engine's own)
    loop:    unpin, count the outcome, start what now fits, wake the saves that
             wait for a write of this tenant (:meth:`TierDriver.wait_written`)

Back-pressure (measured in ``benchmarks/disk_backpressure.py``): a save that finds
shared memory full of unwritten objects waits on the loop for one of its tenant's
write-outs to end, up to ``save_wait_s``, instead of evicting one (``ems.server.
handlers``); on a disk slowed to 10 ms per I/O that took the objects lost from 3.1%
of the saves (written-first eviction alone; 7.2% with one LRU order) to 0.1%.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import (
    Any,
    Callable,
    ClassVar,
    Iterable,
    NamedTuple,
    Optional,
    Sequence,
    TypeVar,
    cast,
)

from ems.disk.stats import LatencyWindow
from ems.pool.core import Pin
from ems.protocol.report import DaemonReport, TierRow, WireRow, hit_rate
from ems.server.fetches import Fetch, FetchBook
from ems.server.memory import SegmentGone, SegmentMaps
from ems.server.ratelimit import RateLimitedLog
from ems.server.tenants import Tenant
from ems.server.tiers import Extent, Loop, MetricFamily, Tier, TierCounters

__all__ = ["HELD", "Admission", "AdmitAll", "DriverSettings", "DriverStatistics", "Engine",
           "ReadOutcome", "SecondHit", "Sources", "Target", "TierDriver", "Written", "leading"]

_Row = TypeVar("_Row", bound=TierRow)
#: a named tuple made without its ``__new__``'s call (``ems.pool.core._new``)
_new = tuple.__new__

logger = logging.getLogger(__name__)


def leading(present: Iterable[bool]) -> int:
    """How many of ``present``, from the first, are true (a leading run)."""
    n = 0
    for hit in present:
        if not hit:
            break
        n += 1
    return n


class ReadOutcome(enum.Enum):
    """What a read into shared memory came to."""

    HIT = "hit"  # the whole value, checked
    MISS = "miss"
    TIMEOUT = "timeout"  # the deadline passed; the memory may hold part of the value
    DAMAGED = "damaged"
    IO_ERROR = "io_error"


@dataclasses.dataclass(frozen=True)
class Written:
    """What a write came to: ``stored``, or the reason it was not (counted as
    ``refused_<reason>``; ``warning``: a line to log, rate-limited per reason)."""

    stored: bool
    reason: str = ""
    warning: Optional[str] = None


WRITTEN = Written(True)
#: the engine held the key already (of that size): nothing written, nothing counted
HELD = Written(True, "held")


class Target(NamedTuple):
    """A key and the memory its value is read into or written from; ``hash``: the
    engine's block hash of a save written through (KV events), where it sent one. (A
    named tuple: a fetch and a write-out make one per value.)"""

    key: str
    memory: memoryview
    hash: Optional[int] = None


class Sources(NamedTuple):
    """A write-out's values as columns: each key, the memory its value is written from,
    and the engine's block hash of each (a save written through: KV events), or None.
    Columns, not a :class:`Target` per value: a 16 KiB spill's writer made a Target
    per value and the disk engine a pair of it again, ~0.2 us a value of the
    interpreter lock the daemon's loop shares."""

    keys: Sequence[str]
    memories: Sequence[memoryview]
    hashes: Optional[Sequence[Optional[int]]] = None

    def targets(self) -> list[Target]:
        """A :class:`Target` per value (an engine that writes one at a time)."""
        hashes = itertools.repeat(None) if self.hashes is None else self.hashes
        return [_new(Target, t) for t in zip(self.keys, self.memories, hashes)]


class Admission:
    """Which new objects of shared memory are written out (on the loop): a small policy
    (CacheLib Navy's admission policies). :meth:`admit_all` is built on :meth:`admit`;
    a policy may override it with the same answers, faster."""

    def admit(self, tenant: Tenant, key: str) -> bool:
        """Whether ``key``, just stored in ``tenant``'s pool, is written out."""
        raise NotImplementedError

    def admit_all(self, tenant: Tenant, keys: Sequence[str]) -> list[bool]:
        """:meth:`admit` of each of a save's ``keys``, in order."""
        return [self.admit(tenant, key) for key in keys]


class AdmitAll(Admission):
    """Every object."""

    def admit(self, tenant: Tenant, key: str) -> bool:
        return True

    def admit_all(self, tenant: Tenant, keys: Sequence[str]) -> list[bool]:
        return [True] * len(keys)


class SecondHit(Admission):
    """Only a key saved again after it left shared memory (one worth keeping): the
    first save of a key is remembered, in a bounded LRU of ``remember`` keys."""

    def __init__(self, remember: int = 1 << 18) -> None:
        self._seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._remember = remember

    def admit(self, tenant: Tenant, key: str) -> bool:
        seen = self._seen
        if (tenant.name, key) in seen:
            del seen[(tenant.name, key)]
            return True
        seen[(tenant.name, key)] = None
        if len(seen) > self._remember:
            seen.popitem(last=False)
        return False


class Engine:
    """Where a tier's bytes live, behind the driver. Every operation is optional and
    its default is neutral; the batched ones are built on the single ones, so an
    override is an optimisation with the same contract. ``lookup`` runs on the loop
    (no I/O); the reads, writes and probes on the driver's workers."""

    #: its name in reports, metrics and pool owners (``disk``, ``cluster``)
    name: ClassVar[str] = "engine"
    #: this host's own (``read_local_only`` loads, a local ``exists``)
    local: ClassVar[bool] = False
    #: takes saves with ``write_rcache`` False (the driver's ``save_through``)
    takes_saves_through: ClassVar[bool] = False
    #: a fetch's keys read in shares, one per reader (True), or in one batch (False)
    parallel_reads: ClassVar[bool] = True
    #: a save's keys written out in one batch (True) or each on its own (False)
    batch_writes: ClassVar[bool] = False
    #: a batch larger than this goes to the writers in chunks of about this many
    #: bytes, written side by side (None: in one piece)
    write_chunk_bytes: Optional[int] = None
    #: a reader's share of a fetch carries at least this many bytes where the fetch
    #: has them (fewer shares than readers then; None: one share per reader). The
    #: disk's is its read chunk: the small parts at the end of a load (``ems.client.
    #: remote._taper``) then still read whole chunks, where 8 shares of a 2 MiB part of
    #: 256 KiB values read 256 KiB each, and the device counts requests (those loads
    #: ran at 1.65 GB/s against 1.67 before the taper, 1.73 with this)
    read_share_bytes: Optional[int] = None
    admission: Admission = AdmitAll()

    def usable(self) -> bool:
        """False: the engine is off; the driver then handles nothing."""
        return True

    def ready(self) -> bool:
        """False while the engine cannot answer yet (the disk recovering)."""
        return True

    def wait_ready(self, timeout_s: float) -> None:
        """Block (on a worker) until :meth:`ready` or ``timeout_s`` passed."""

    def opened(self, tenant: Tenant) -> None:
        """The driver meets ``tenant`` for the first time (before its first write)."""

    def lookup(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]]
               ) -> Optional[list[int]]:
        """The sizes of the leading run of ``keys`` held (of ``sizes`` where given),
        from the engine's index without I/O; None: it cannot tell without I/O (a
        remote engine: the driver then reads or :meth:`probe`\\ s to find out)."""
        return None

    def probe(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
              deadline: float) -> list[bool]:
        """Which of ``keys`` are held (with I/O, by ``deadline``); default: none."""
        return [False] * len(keys)

    def read(self, tenant: Tenant, target: Target, deadline: float) -> ReadOutcome:
        """Read ``target.key``'s value into ``target.memory`` (exactly its size)."""
        return ReadOutcome.MISS

    def read_batch(self, tenant: Tenant, targets: Sequence[Target], deadline: float
                   ) -> list[ReadOutcome]:
        return [self.read(tenant, t, deadline) for t in targets]

    def write(self, tenant: Tenant, source: Target, deadline: Optional[float]) -> Written:
        """Store ``source.memory`` as ``source.key``'s value; :data:`HELD` (nothing
        written) where the engine holds the key with a value of that size already."""
        return Written(False, "unsupported")

    def write_batch(self, tenant: Tenant, sources: Sources, deadline: Optional[float]
                    ) -> list[Written]:
        """:meth:`write` of each of ``sources`` (one outcome per key, in order)."""
        return [self.write(tenant, t, deadline) for t in sources.targets()]

    def report(self, books: DriverStatistics) -> Optional[WireRow]:
        """The tier's part of the daemon's report, from the driver's ``books``."""
        return None

    def tenant_report(self, tenant: Tenant, books: DriverStatistics) -> Optional[TierRow]:
        """One tenant's row (``tenants[name].tiers.<engine name>``)."""
        return books.tier_row(TierRow)

    def metric_families(self, report: DaemonReport) -> list[MetricFamily]:
        """The engine's own Prometheus families (``Tier.metric_families``)."""
        return []

    def close(self) -> None:
        """The daemon stops (the driver's workers are done)."""


@dataclasses.dataclass(frozen=True)
class DriverSettings:
    """How a driver bounds its engine's work."""

    #: reader and writer threads
    read_workers: int = 4
    write_workers: int = 4
    #: a read, probe or save-through gets at most this long (s), whatever the request
    max_op_s: float = 30.0
    #: the deadline of a write-out (s; None: the engine's own)
    write_out_s: Optional[float] = None
    #: bytes pinned and being written out, in all
    inflight_bytes: int = 64 << 20
    #: share of a tenant's pool pinned for write-out (None: only ``inflight_bytes``)
    tenant_share: Optional[float] = None
    #: bytes waiting to be written out (0: none wait, past the bound a save is dropped)
    queue_bytes: int = 0
    #: a save that finds shared memory full of objects not written out yet waits
    #: this long at most (s) for the writer before it evicts one (0: never waits)
    save_wait_s: float = 0.0
    #: the setting that bounds the bytes in flight or waiting (named in the warning)
    bound_setting: str = "inflight_bytes"
    #: at stop, write what shared memory holds and the engine lacks, for at most (s)
    flush_on_stop_s: float = 0.0
    #: keys saved with ``write_out`` False remembered, so the stop's flush passes them
    #: over (an LRU; past it the oldest are forgotten, counted as
    #: ``skipped_forgotten``, and a stop may write those out)
    skipped_remember: int = 1 << 18


@dataclasses.dataclass(frozen=True)
class DriverStatistics:
    """The driver's counters of one engine (in all, or of one tenant: then the
    queue and latency figures are 0)."""

    lookups: int
    hits: int
    misses: int
    bytes_in: int
    writes: int
    bytes_out: int
    #: writes not done, by reason (the engine's ``Written.reason``)
    refused: dict[str, int]
    #: saves past the queue or in-flight bound, not written out
    dropped: int
    not_admitted: int
    #: new objects the caller asked to keep in shared memory (``CcKvOption.write_out``)
    skipped_caller: int
    #: of those, the ones past ``skipped_remember`` (a stop's flush may write them)
    skipped_forgotten: int
    #: queued write-outs whose objects shared memory evicted before their turn
    evicted_before_write: int
    #: saves that found shared memory full of unwritten objects and waited for a write
    save_waits: int
    read_timeouts: int
    read_damaged: int
    read_io_errors: int
    flushed_on_stop: int
    batches: int
    queued_bytes: int
    inflight_bytes: int
    latency_p50_ms: float
    latency_p99_ms: float
    latency_max_ms: float

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hits, self.misses)

    @property
    def unwritten(self) -> dict[str, int]:
        """New objects of shared memory not written out, by reason: the queue's bound
        (``queue_full``), the engine's refusals (``write_budget``, ``quota``,
        ``no_space``, ...), the admission policy (``admission``), the caller's
        ``write_out`` False (``caller``), evicted before their turn
        (``evicted_unwritten``)."""
        out = {"queue_full": self.dropped, "admission": self.not_admitted,
               "caller": self.skipped_caller, "evicted_unwritten": self.evicted_before_write}
        for reason, n in self.refused.items():
            out["write_budget" if reason == "budget" else reason] = n
        return out

    def tier_row(self, kind: type[_Row], **more: Any) -> _Row:
        """The lookup and write figures every tier reports, as a ``kind`` row
        (``TierRow`` or a tier's own with ``more`` fields)."""
        return kind(hits=self.hits, misses=self.misses, bytes_in=self.bytes_in,
                    writes=self.writes, bytes_out=self.bytes_out, **more)


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A write-out waiting: a save's keys (one, unless the engine writes in batches)."""

    tenant: Tenant
    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    size: int


class TierDriver(Tier):
    """The tier seam for one :class:`Engine` (module docstring). Hooks run on the
    event loop; the engine's I/O on the driver's workers."""

    def __init__(self, engine: Engine, loop: Loop, settings: DriverSettings,
                 tenants: Callable[[], Iterable[Tenant]] = lambda: (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        #: monotonic seconds of the driver's own decisions: deadlines, their timers on
        #: the loop, the saves' waits (the daemon's clock; a test's FakeClock). The
        #: engine runs on threads against real time: it is handed deadlines in
        #: ``time.monotonic`` (:meth:`_engine_deadline`)
        self._clock = clock
        self.settings = settings
        self.name = engine.name  # type: ignore[misc]
        self.local = engine.local  # type: ignore[misc]
        self.takes_saves_through = engine.takes_saves_through  # type: ignore[misc]
        self.wants_stored = True  # type: ignore[misc]
        self._loop = loop
        self._tenants = tenants
        self._readers = ThreadPoolExecutor(settings.read_workers,
                                           thread_name_prefix=f"ems-{engine.name}-read")
        self._writers = ThreadPoolExecutor(settings.write_workers,
                                           thread_name_prefix=f"ems-{engine.name}-write")
        self._memory = SegmentMaps()
        self._fetches = FetchBook((f"ems-{engine.name}", "fetch"))
        self._write_owner = (f"ems-{engine.name}", "write")
        self._queue: collections.deque[_Pending] = collections.deque()
        #: (tenant, key) of the objects saved with ``write_out`` False (see ``stored``)
        self._skipped: collections.OrderedDict[tuple[str, str], None] = (
            collections.OrderedDict())
        self._queued_bytes = 0
        self._inflight_bytes = 0
        self._inflight_per_tenant: dict[str, int] = {}
        self._queued_per_tenant: collections.Counter[str] = collections.Counter()
        #: saves waiting for a write-out of their tenant to end (``wait_written``)
        self._waiters: dict[str, list[Callable[[], None]]] = {}
        self._met: set[str] = set()
        self._counters = TierCounters()
        self._latency = LatencyWindow(512)
        self._max_latency_s = 0.0
        self._warnings: dict[str, RateLimitedLog] = {}
        self._closed = False
        for tenant in tenants():  # mapped and populated before their first request
            self._memory.prepare(tenant)

    # ------------------------------------------------------------ plumbing
    def _usable(self) -> bool:
        return not self._closed and self.engine.usable()

    def _deadline(self, deadline: Optional[float]) -> float:
        """A request's deadline (on the driver's clock), capped by ``max_op_s``."""
        cap = self._clock() + self.settings.max_op_s
        return cap if deadline is None else min(deadline, cap)

    def _engine_deadline(self, deadline: float) -> float:
        """``deadline`` on the driver's clock as the engine sees it: ``time.monotonic``
        seconds (the same time left), for the I/O it bounds on its own threads."""
        if self._clock is time.monotonic:
            return deadline
        return time.monotonic() + (deadline - self._clock())

    def _warn(self, reason: str, message: str) -> None:
        log = self._warnings.get(reason)
        if log is None:
            log = self._warnings[reason] = RateLimitedLog(logger)
        log.warn(f"ems {self.engine.name}: {message}")

    def _timed(self, started: float) -> None:
        took = time.monotonic() - started
        self._latency.add(took)
        self._max_latency_s = max(self._max_latency_s, took)  # (a race loses a max only)
        self._counters.add(batches=1)

    def _when_ready(self, deadline: float, then: Callable[[], None]) -> None:
        """Run ``then`` on the loop once the engine is ready or ``deadline`` passed
        (the wait happens on a reader, never on the loop)."""
        left_s = deadline - self._clock()  # (measured now, on the driver's clock)

        def wait() -> None:
            self.engine.wait_ready(max(0.0, left_s))
            self._loop.call_soon(then)
        self._readers.submit(wait)

    def _meet(self, tenant: Tenant) -> None:
        if tenant.name not in self._met:
            self._met.add(tenant.name)
            self.engine.opened(tenant)

    # ------------------------------------------------------------ loads
    def fill(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
             deadline: Optional[float], done: Callable[[], None]) -> bool:
        """Bring the leading keys the engine holds into the tenant's pool (module doc);
        a load that arrives before the engine is ready waits within its deadline."""
        if not self._usable():
            return False
        limit = self._deadline(deadline)
        if not self.engine.ready():
            def retry() -> None:
                if not self._fill(tenant, keys, sizes, limit, done):
                    done()
            self._when_ready(limit, retry)
            return True
        return self._fill(tenant, keys, sizes, limit, done)

    def _fill(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
              deadline: float, done: Callable[[], None]) -> bool:
        if not self._usable():
            return False
        run = self.engine.lookup(tenant, keys, sizes)
        if run is None:  # found out by reading: a value's size is needed to reserve it
            if sizes is None:
                return False
            run = list(sizes)
        if not run:
            self._counters.add(tenant, lookups=1, misses=1)
            return False
        return self._fetches.plan(tenant, keys[:len(run)], run, done,
                                  lambda fetch: self._read(fetch, deadline))

    def _read(self, fetch: Fetch, deadline: float) -> None:
        """Read the fetch's keys into their reservations, on the readers.

        The fetch finishes on the loop when the last read returned or at ``deadline``,
        whichever comes first: a read still running then (one I/O cannot be
        interrupted) keeps its reservation until it returns, and is then aborted; the
        request is answered by its deadline without it, and its bytes never become
        visible."""
        tenant, engine = fetch.tenant, self.engine
        reserved = fetch.reserved
        results: list[Optional[ReadOutcome]] = [None] * len(reserved)
        left = [len(reserved)]
        finished = [False]
        lock = threading.Lock()
        engine_deadline = self._engine_deadline(deadline)

        def finish() -> None:  # on the loop: the last read returned, or the deadline
            with lock:
                if finished[0]:
                    return
                finished[0] = True
                now = list(results)
            late = [i for i, r in enumerate(now) if r is None]
            ok = [r is ReadOutcome.HIT for r in now]
            hits = sum(ok)
            self._counters.add(
                tenant, lookups=len(ok), hits=hits, misses=len(ok) - hits,
                bytes_in=sum(r.grant.size for r, good in zip(reserved, ok) if good),
                read_timeouts=len(late) + now.count(ReadOutcome.TIMEOUT),
                read_damaged=now.count(ReadOutcome.DAMAGED),
                read_io_errors=now.count(ReadOutcome.IO_ERROR))
            self._fetches.finish(fetch, ok, late)

        def job(indexes: list[int]) -> None:
            started = time.monotonic()
            outcomes: list[ReadOutcome]
            views: list[memoryview] = []
            try:
                grants = [reserved[i].grant for i in indexes]
                views = self._memory.views(tenant, [g.offset for g in grants],
                                           [g.size for g in grants])
                outcomes = engine.read_batch(tenant, [  # (``_new``: a Target per value)
                    _new(Target, (reserved[i].key, v, None)) for i, v in zip(indexes, views)],
                    engine_deadline)
            except SegmentGone:  # the tenant was deleted meanwhile: nowhere to read into
                outcomes = [ReadOutcome.MISS] * len(indexes)
            except Exception:  # noqa: BLE001 - a bug is a miss, never a stuck request
                logger.exception("ems %s: a read failed", engine.name)
                outcomes = [ReadOutcome.IO_ERROR] * len(indexes)
            finally:
                for v in views:
                    v.release()
            self._timed(started)
            with lock:
                if finished[0]:  # answered without them: give their space back
                    self._loop.call_soon(lambda: self._fetches.abort_late(fetch, indexes))
                    return
                for i, outcome in zip(indexes, outcomes):
                    results[i] = outcome
                left[0] -= len(indexes)
                last = left[0] == 0
            if last:
                self._loop.call_soon(finish)

        self._loop.call_at(deadline, finish)
        n = len(reserved)
        # Parallel: a contiguous share of the keys per reader, each read after the
        # other there (``read_workers`` deep, a sequential stream each). A job per key
        # cost the daemon ~150 us of CPU per 16 KiB value loaded (a submit, a thread
        # hand-over and a loop callback each); the share keeps the depth without it.
        jobs = min(n, self.settings.read_workers) if engine.parallel_reads else 1
        least = engine.read_share_bytes
        if least and jobs > 1:  # (a small part: fewer shares, each a whole read)
            jobs = max(1, min(jobs, sum(r.grant.size for r in reserved) // least))
        for j in range(jobs):
            self._readers.submit(job, list(range(j * n // jobs, (j + 1) * n // jobs)))

    def count(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
              deadline: Optional[float], done: Callable[[int], None]) -> bool:
        """The leading keys the engine holds: from its index (no I/O), else probed on
        a reader; waits for an engine not ready yet within the deadline."""
        if not self._usable():
            return False
        limit = self._deadline(deadline)
        if not self.engine.ready():
            self._when_ready(limit, lambda: self._count(tenant, keys, sizes, limit, done))
        else:
            self._count(tenant, keys, sizes, limit, done)
        return True

    def _count(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
               deadline: float, done: Callable[[int], None]) -> None:
        run = self.engine.lookup(tenant, keys, sizes) if self._usable() else []
        if run is not None:
            done(len(run))
            return

        engine_deadline = self._engine_deadline(deadline)

        def probe() -> None:
            started = time.monotonic()
            try:
                present = self.engine.probe(tenant, keys, sizes, engine_deadline)
            except Exception:  # noqa: BLE001 - the answer still comes (none present)
                logger.exception("ems %s: a probe failed", self.engine.name)
                present = []
            self._timed(started)
            self._loop.call_soon(lambda: done(leading(present)))
        self._readers.submit(probe)

    # ------------------------------------------------------------ writes
    def stored(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int],
               hashes: Optional[Sequence[Optional[int]]] = None, *,
               write_out: bool = True) -> None:
        """Write the new objects of a save out (the caller's ``write_out``, admission,
        then the bounds)."""
        if not self._usable():
            return
        self._meet(tenant)
        skipped = self._skipped
        if not write_out:  # before the policy: SecondHit does not remember them
            self._counters.add(tenant, skipped_caller=len(keys))
            for key in keys:
                skipped[(tenant.name, key)] = None
            forgotten = len(skipped) - self.settings.skipped_remember
            if forgotten > 0:
                self._counters.add(tenant, skipped_forgotten=forgotten)
                for _ in range(forgotten):
                    skipped.popitem(last=False)
            return
        if skipped:  # a key saved again after it left shared memory, to be written now
            for key in keys:
                skipped.pop((tenant.name, key), None)
        admit = self.engine.admission.admit_all(tenant, keys)
        if all(admit):
            keys, sizes = tuple(keys), tuple(sizes)
        else:
            self._counters.add(tenant, not_admitted=admit.count(False))
            keys = tuple(key for key, ok in zip(keys, admit) if ok)
            sizes = tuple(size for size, ok in zip(sizes, admit) if ok)
            if not keys:
                return
        if self.engine.batch_writes:
            self._offer(_Pending(tenant, keys, sizes, sum(sizes)))
        else:
            for key, size in zip(keys, sizes):
                self._offer(_Pending(tenant, (key,), (size,), size))

    def _offer(self, p: _Pending) -> None:
        if not self._queue and self._fits(p):
            self._start(p)
        elif self._queued_bytes + p.size <= self.settings.queue_bytes:
            self._queue.append(p)
            self._queued_bytes += p.size
            self._queued_per_tenant[p.tenant.name] += p.size
            p.tenant.pool.mark_unwritten(p.keys)  # evicted after the written ones
        else:
            self._counters.add(p.tenant, dropped=len(p.keys))
            self._warn("dropped", f"{self._queued_bytes + self._inflight_bytes} bytes wait "
                                  f"or are being written, the bound "
                                  f"({self.settings.bound_setting}): saves are not written "
                                  f"out until it drains (counted as dropped)")

    def _fits(self, p: _Pending) -> bool:
        """Whether ``p`` may start now. A value being written is pinned in shared
        memory, where it cannot be evicted: ``tenant_share`` of a tenant's pool at
        most is pinned so (and ``inflight_bytes`` in all), so an engine slower than
        the saves never makes shared memory refuse them. With a queue, one value
        larger than the bounds goes alone (it could never leave the queue else)."""
        settings, inflight = self.settings, self._inflight_bytes
        if not inflight and settings.queue_bytes:
            return True
        if inflight + p.size > settings.inflight_bytes:
            return False
        mine = self._inflight_per_tenant.get(p.tenant.name, 0)
        share = settings.tenant_share
        return share is None or not mine or (
            mine + p.size <= int(p.tenant.pool.capacity_bytes * share))

    def _pump(self) -> None:
        """Start queued write-outs while the bounds allow (on the loop)."""
        queue = self._queue
        while queue and not self._closed and self._fits(queue[0]):
            p = queue.popleft()
            self._queued_bytes -= p.size
            self._queued_per_tenant[p.tenant.name] -= p.size
            p.tenant.pool.mark_written(p.keys)  # pinned from here, or gone
            self._start(p)

    def _start(self, p: _Pending) -> None:
        """Pin what is still in shared memory of ``p`` and hand it to the writers. Whether
        the engine holds a key already is its own check, made once, when it writes
        (under its own lock: ``HELD``), not here as well.

        A save larger than the engine's write chunk goes to the writers in chunks (cut
        by the sizes it was saved with), written side by side (the device's queue
        depth); each chunk is held under one token (``Pool.hold``) and let go when its
        write is done."""
        chunk = self.engine.write_chunk_bytes or p.size
        sizes = p.sizes
        first = filled = 0
        for i, size in enumerate(sizes):
            if i > first and filled + size > chunk:
                self._write_chunk(p.tenant, p.keys[first:i])
                first, filled = i, 0
            filled += size
        self._write_chunk(p.tenant, p.keys[first:])

    def _write_chunk(self, tenant: Tenant, keys: Sequence[str]) -> None:
        held = tenant.pool.hold(keys, self._write_owner)
        if len(held.keys) < len(keys):  # evicted (or deleted) before its turn
            self._counters.add(tenant, evicted_before_write=len(set(keys)) - len(held.keys))
        if not held.keys:
            return
        nbytes = sum(held.sizes)
        self._inflight_bytes += nbytes
        self._inflight_per_tenant[tenant.name] = (
            self._inflight_per_tenant.get(tenant.name, 0) + nbytes)
        out_s = self.settings.write_out_s
        deadline = None if out_s is None else self._clock() + out_s

        def written(outcomes: list[Written]) -> None:
            tenant.pool.release_held(held.token, self._write_owner)
            self._inflight_bytes -= nbytes
            self._inflight_per_tenant[tenant.name] -= nbytes
            self._pump()
            for wake in self._waiters.pop(tenant.name, ()):
                wake()
        self._write(tenant, cast(list[str], held.keys), held.offsets, held.sizes, deadline,
                    written)  # (the driver's pool keys are str)

    def removed(self, tenant: Tenant) -> None:
        """``tenant`` was deleted (its sessions closed; on the loop, before its memory's
        descriptor is closed): its write-outs still queued are dropped (the operator
        deleted what they would write; not counted as unwritten), the saves waiting for
        its writer are woken (their sessions are gone), and its memory is let go
        (``SegmentMaps.forget``): unmapped now, or when the reads and writes in flight
        end, each of which then completes as usual. A tenant of the same name made later
        is new to the engine (:meth:`_meet`)."""
        kept = collections.deque(p for p in self._queue if p.tenant is not tenant)
        if len(kept) != len(self._queue):
            self._queue = kept
            self._queued_bytes = sum(p.size for p in kept)
        self._queued_per_tenant.pop(tenant.name, None)
        for gone in [k for k in self._skipped if k[0] == tenant.name]:
            del self._skipped[gone]
        self._met.discard(tenant.name)
        for wake in self._waiters.pop(tenant.name, ()):
            wake()
        self._memory.forget(tenant)

    def wait_written(self, tenant: Tenant, since: float, until: Optional[float],
                     then: Callable[[], None]) -> bool:
        """Call ``then`` on the loop once one of ``tenant``'s write-outs has ended (its
        values unpinned and written: evictable without loss) or ``save_wait_s`` after
        ``since`` (or at ``until``, where the save's deadline says so), whichever first;
        False (``then`` not called) when that time has passed or no write-out of the
        tenant is queued or running: nothing to wait for (``ems.server.handlers``,
        "Back-pressure")."""
        name = tenant.name
        deadline = since + self.settings.save_wait_s
        if until is not None and until < deadline:
            deadline = until
        if self._closed or self._clock() >= deadline or not (
                self._inflight_per_tenant.get(name, 0) or self._queued_per_tenant[name]):
            return False
        fired = [False]

        def once() -> None:
            if not fired[0]:
                fired[0] = True
                then()
        self._waiters.setdefault(name, []).append(once)
        self._loop.call_at(deadline, once)
        self._counters.add(tenant, save_waits=1)
        return True

    def save_through(self, tenant: Tenant, keys: Sequence[str], extents: Sequence[Extent],
                     deadline: Optional[float], done: Callable[[list[bool]], None],
                     hashes: Optional[Sequence[Optional[int]]] = None) -> bool:
        """A save with ``write_rcache`` False: to the engine only (no local copy)."""
        if not self.engine.takes_saves_through or not self._usable():
            return False
        self._write(tenant, keys, [e.offset for e in extents], [e.size for e in extents],
                    self._deadline(deadline),
                    lambda outcomes: done([w.stored for w in outcomes]), hashes)
        return True

    def _write(self, tenant: Tenant, keys: Sequence[str], offsets: Sequence[int],
               sizes: Sequence[int], deadline: Optional[float],
               then: Callable[[list[Written]], None],
               hashes: Optional[Sequence[Optional[int]]] = None) -> None:
        """Write each key from its pool memory (at its offset, of its size) on a writer;
        count, then ``then`` on the loop (a failure is an outcome, never a stuck pin).
        ``hashes``: the engine's block hashes of a save written through
        (``Target.hash``)."""
        engine = self.engine
        engine_deadline = None if deadline is None else self._engine_deadline(deadline)

        def job() -> None:
            started = time.monotonic()
            views: list[memoryview] = []
            outcomes: list[Written]
            try:
                views = self._memory.views(tenant, offsets, sizes)
                outcomes = engine.write_batch(tenant, Sources(keys, views, hashes),
                                              engine_deadline)
            except SegmentGone:  # the tenant was deleted meanwhile, its saves with it
                outcomes = [Written(False, "tenant_deleted")] * len(keys)
            except Exception:  # noqa: BLE001 - a bug is a write not done
                logger.exception("ems %s: a write failed", engine.name)
                outcomes = [Written(False, "io_error")] * len(keys)
            finally:
                for v in views:
                    v.release()
            self._timed(started)
            self._loop.call_soon(lambda: done(outcomes))

        def done(outcomes: list[Written]) -> None:
            # Counted once per write, not per record (each count takes the counters'
            # lock and updates two Counters): the writes summed in two ints, the
            # refusals by reason.
            counts: collections.Counter[str] = collections.Counter()
            writes = outcomes.count(WRITTEN)  # (at C speed: every one, usually)
            if writes == len(outcomes):
                bytes_out = sum(sizes)
            else:
                writes = bytes_out = 0
                for w, n in zip(outcomes, sizes):
                    if w.stored:
                        if w is not HELD:
                            writes += 1
                            bytes_out += n
                    else:
                        counts[f"refused_{w.reason}"] += 1
                        if w.warning:
                            self._warn(w.reason, w.warning)
            if writes:
                counts.update(writes=writes, bytes_out=bytes_out)
            self._counters.add(tenant, **counts)
            then(outcomes)
        self._writers.submit(job)

    # ------------------------------------------------------------ report
    def statistics(self, tenant: Optional[Tenant] = None) -> DriverStatistics:
        """The driver's figures, in all or of ``tenant``."""
        c = self._counters.totals() if tenant is None else self._counters.of(tenant)
        whole = tenant is None

        def ms(seconds: Optional[float]) -> float:
            return round(seconds * 1000, 3) if seconds is not None and whole else 0.0
        return DriverStatistics(
            lookups=c.get("lookups", 0), hits=c.get("hits", 0), misses=c.get("misses", 0),
            bytes_in=c.get("bytes_in", 0), writes=c.get("writes", 0),
            bytes_out=c.get("bytes_out", 0),
            refused={k[len("refused_"):]: v for k, v in c.items() if k.startswith("refused_")},
            dropped=c.get("dropped", 0), not_admitted=c.get("not_admitted", 0),
            skipped_caller=c.get("skipped_caller", 0),
            skipped_forgotten=c.get("skipped_forgotten", 0),
            evicted_before_write=c.get("evicted_before_write", 0),
            save_waits=c.get("save_waits", 0),
            read_timeouts=c.get("read_timeouts", 0), read_damaged=c.get("read_damaged", 0),
            read_io_errors=c.get("read_io_errors", 0),
            flushed_on_stop=c.get("flushed_on_stop", 0), batches=c.get("batches", 0),
            queued_bytes=self._queued_bytes if whole else 0,
            inflight_bytes=self._inflight_bytes if whole else 0,
            latency_p50_ms=ms(self._latency.quantile(0.5)),
            latency_p99_ms=ms(self._latency.quantile(0.99)),
            latency_max_ms=ms(self._max_latency_s))

    def report(self) -> Optional[WireRow]:
        return self.engine.report(self.statistics())

    def tenant_report(self, tenant: Tenant) -> Optional[TierRow]:
        return self.engine.tenant_report(tenant, self.statistics(tenant))

    def metric_families(self, report: DaemonReport) -> list[MetricFamily]:
        return self.engine.metric_families(report)

    # ------------------------------------------------------------ stop
    def close(self) -> None:
        """Flush what shared memory holds and the engine lacks (``flush_on_stop_s``),
        stop the workers (their reads end by their deadlines; their completions are
        queued on the loop, which runs them next), then the engine."""
        if self._closed:
            return
        self._closed = True
        if self.settings.flush_on_stop_s > 0 and self.engine.usable() and self.engine.ready():
            # real time, not the driver's clock: the stop blocks on the writers' threads
            self._flush(time.monotonic() + self.settings.flush_on_stop_s)
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._writers.shutdown(wait=True)
        self.engine.close()
        self._loop.call_soon(self._memory.close)  # after the completions queued before

    def _flush(self, deadline: float) -> None:
        """On the loop, which has stopped serving: pin every object the engine lacks,
        write them on the writers, wait until ``deadline``, unpin."""
        self._queue.clear()
        self._queued_bytes = 0
        self._queued_per_tenant.clear()
        jobs: list[tuple[Tenant, str, Pin]] = []
        for tenant in self._tenants():
            self._meet(tenant)
            pool = tenant.pool
            for key in pool.keys():
                if not isinstance(key, str) or (tenant.name, key) in self._skipped or \
                        self.engine.lookup(tenant, [key], None):
                    continue  # (not a key, the caller's write_out False, held already)
                got = pool.acquire([key], None, self._write_owner, count=False)
                if got:
                    jobs.append((tenant, key, got[0]))

        def write(tenant: Tenant, key: str, pin: Pin) -> bool:
            if time.monotonic() >= deadline:
                return False
            view = self._memory.view(tenant, pin.offset, pin.size)
            try:
                return self.engine.write(tenant, Target(key, view), deadline).stored
            finally:
                view.release()

        futures = [self._writers.submit(write, *job) for job in jobs]
        done, late = concurrent.futures.wait(futures,
                                             timeout=max(0.0, deadline - time.monotonic()))
        for f in late:
            f.cancel()
        flushed = sum(1 for f in done if not f.cancelled() and f.exception() is None
                      and f.result())
        self._counters.add(flushed_on_stop=flushed)
        if jobs:
            logger.info("ems %s: wrote %d of %d objects of shared memory at stop (%s)",
                        self.engine.name, flushed, len(jobs), "all" if flushed == len(jobs)
                        else f"flush_on_stop_s {self.settings.flush_on_stop_s:g} s reached")
        self._writers.shutdown(wait=True, cancel_futures=True)
        for tenant, _, pin in jobs:
            tenant.pool.release([pin.token], self._write_owner)
