"""The daemon's disk tier: shared memory backed by region files on a local SSD.

With ``--disk DIR`` every tenant's pool gets a second, larger tier on the host's
disk (``ems.disk.DiskStore``: append-only region files with checksummed records and
an index checkpointed every ``checkpoint_s``). The SDK's calls do not change:

* **Saves.** An object committed in shared memory is queued to be written to disk
  (``admission = "all"``; ``"second-hit"``: only a key saved again after it left shared
  memory, i.e. one worth keeping). A worker writes it from the pool memory, pinned
  meanwhile, so the write costs no copy beyond the disk's own. Writes in flight are
  bounded (``inflight``, 64 MiB), and so are the bytes waiting (``queue``, 1 GiB; past
  it a save is not written to disk, counted as ``queue_dropped``).
* **Loads.** Lookups go shared memory -> disk -> cluster. A load's keys that shared
  memory misses and the disk index has are read (in parallel, one worker each) into
  reserved pool space, checked, committed, then pinned for the client like any local
  hit: the tier is inclusive (the disk copy stays until the disk evicts it). ``exists``
  and ``read_local_only`` count the disk as this host's own.

Why write-through at save and not spill at eviction: an eviction happens inside a
reservation, on the event loop, and must hand the victim's extent to the new key at
once. Spilling then means either a disk write on the loop (forbidden: a slow disk
would stall every client) or a copy of each victim into a staging buffer first (one
more memcpy of every evicted byte on the loop, ~100 us per MiB here, and staging
memory beside the pool). Writing through right after the save costs neither: the
worker writes straight from the pinned pool memory, eviction stays a dictionary
operation, and an object is on disk within milliseconds of its save, which is what
makes the tier survive ``kill -9``. The price is that objects never evicted are
written too: in a cache that runs full (the steady state) nearly every object is
evicted sooner or later, and ``second-hit`` admission and ``write_budget`` bound the
wear where that is not so.

Deadlines: a load's disk reads get the request's deadline (80% of what is left,
``ems.server.handlers.BUDGET_SHARE``), never more than half the reservation TTL. A
read checks the deadline between chunks (``ems.disk``) and says TIMEOUT; the request
is answered only after every read of it returned, so no byte reaches the pool space
of a key after the key was aborted, and the client's copy starts only from committed,
checksummed bytes. A load or ``exists`` that arrives while the store recovers waits
for the recovery within its own deadline (on a worker, never on the loop).

Faults: ENOSPC or a tenant's disk share full -> nothing more admitted (one warning, a
counter), shared memory keeps serving; EIO on a read -> a miss, counted; the
directory removed or unwritable -> the store turns off (one error line) and the
daemon keeps serving from shared memory.

Stop: SIGTERM writes the objects of shared memory that are not on disk yet, for at
most ``flush_on_stop_s``, then checkpoints and marks a clean shutdown, so the next
start skips the scan and finds everything that fitted on the disk.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ClassVar, Iterable, Optional, Sequence

from ems.disk import DiskSettings, DiskState, DiskStore, DiskStoreLocked, ReadResult, WriteResult
from ems.pool.core import Pin
from ems.server.config import ANONYMOUS, DiskConfig, ServerConfig
from ems.server.fetches import Fetch, FetchBook
from ems.server.memory import SegmentMaps
from ems.server.tenants import Tenant
from ems.server.tiers import Loop, Report, Tier, TierCounters

__all__ = ["DiskTier", "start"]

logger = logging.getLogger(__name__)

#: Pool owners of what the tier holds: reservations being read into, values being written.
FETCH_OWNER = ("ems-disk", "fetch")
WRITE_OWNER = ("ems-disk", "write")
#: keys remembered for ``second-hit`` admission (a bounded LRU of keys seen once)
_SEEN_KEYS = 1 << 18
_WARN_EVERY_S = 10.0


@dataclasses.dataclass(frozen=True)
class _Pending:
    """An object waiting to be written to disk."""

    tenant: Tenant
    key: str
    size: int


class DiskTier(Tier):
    """See the module docstring. Hooks run on the event loop; disk I/O on the workers
    (reads and writes on separate pools: a load never waits behind spills)."""

    name: ClassVar[str] = "disk"
    local: ClassVar[bool] = True
    wants_stored: ClassVar[bool] = True

    def __init__(self, config: DiskConfig, pool_capacity_bytes: int, loop: Loop,
                 tenants: Callable[[], Iterable[Tenant]], reservation_ttl_s: float = 60.0
                 ) -> None:
        self.config = config
        self.store = DiskStore(DiskSettings(
            path=config.path, capacity_bytes=config.capacity_bytes,
            checkpoint_s=config.checkpoint_s,
            write_budget_bytes_per_day=config.write_budget_bytes_per_day,
            io_delay_s=config.io_delay_ms / 1000))
        self.store.open()  # recovery runs in the background from here
        self._loop = loop
        self._tenants = tenants
        self._pool_capacity = max(1, pool_capacity_bytes)
        self._max_read_s = reservation_ttl_s / 2
        self._readers = ThreadPoolExecutor(config.io_threads, thread_name_prefix="ems-disk-read")
        self._writers = ThreadPoolExecutor(max(1, config.io_threads // 2),
                                           thread_name_prefix="ems-disk-write")
        self._memory = SegmentMaps()
        self._fetches = FetchBook(FETCH_OWNER)
        self._queue: collections.deque[_Pending] = collections.deque()
        self._queued_bytes = 0
        self._inflight_bytes = 0
        self._inflight_per_tenant: dict[str, int] = {}
        self._quota_set: set[str] = set()
        self._seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._warned_at: dict[str, float] = {}
        self._counters = TierCounters()
        self._closed = False

    # ------------------------------------------------------------ plumbing
    def _warn(self, what: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at.get(what, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned_at[what] = now
            logger.warning("ems disk: %s", message)

    def _quota(self, tenant: Tenant) -> None:
        """Give the store ``tenant``'s disk share once: its ``[disk.quotas]`` entry, else
        its share of the pools' memory applied to the disk's capacity."""
        if tenant.name in self._quota_set:
            return
        self._quota_set.add(tenant.name)
        key = tenant.spec.access_id if tenant.spec.access_id is not None else ANONYMOUS
        share = self.config.quotas_bytes.get(key)
        if share is None:
            share = int(self.config.capacity_bytes * min(1.0, tenant.segment_size /
                                                         self._pool_capacity))
        self.store.set_quota(tenant.name, share)

    def _usable(self) -> bool:
        return not self._closed and self.store.state is not DiskState.OFF

    def _deadline(self, deadline: Optional[float]) -> float:
        cap = time.monotonic() + self._max_read_s
        return cap if deadline is None else min(deadline, cap)

    def _after_recovery(self, deadline: float, then: Callable[[], None]) -> None:
        """Run ``then`` on the loop once recovery is over or ``deadline`` passed (the
        wait happens on a worker, never on the loop)."""
        def wait() -> None:
            self.store.wait_recovered(deadline - time.monotonic())
            self._loop.call_soon(then)
        self._readers.submit(wait)

    # ------------------------------------------------------------ loads
    def fill(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
             deadline: Optional[float], done: Callable[[], None]) -> bool:
        """Read the leading keys the disk holds into the tenant's pool (module doc)."""
        if not self._usable():
            return False
        limit = self._deadline(deadline)
        if self.store.recovering:
            def retry() -> None:
                if not self._fill(tenant, keys, sizes, limit, done):
                    done()
            self._after_recovery(limit, retry)
            return True
        return self._fill(tenant, keys, sizes, limit, done)

    def _fill(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
              deadline: float, done: Callable[[], None]) -> bool:
        if not self._usable():
            return False
        store, name = self.store, tenant.name
        run: list[int] = []
        for i, key in enumerate(keys):
            size = store.size_of(name, key)
            if size is None or (sizes is not None and sizes[i] != size):
                break
            run.append(size)
        if not run:
            self._counters.add(tenant, lookups=1, misses=1)
            return False
        return self._fetches.plan(tenant, keys[:len(run)], run, done,
                                  lambda fetch: self._read(fetch, deadline))

    def _read(self, fetch: Fetch, deadline: float) -> None:
        """Read each key of ``fetch`` on its own worker (a load's blocks in parallel).

        The fetch finishes on the loop when the last read returned or at ``deadline``,
        whichever comes first: a read still running then (a disk slower than the
        deadline: one I/O cannot be interrupted) keeps its reservation until it
        returns, and is then aborted; the request is answered by its deadline without
        it, and its bytes never become visible."""
        tenant, store = fetch.tenant, self.store
        reserved = fetch.reserved
        results: list[Optional[ReadResult]] = [None] * len(reserved)
        state = {"left": len(reserved), "finished": False}
        lock = threading.Lock()

        def finish() -> None:  # on the loop: the last read returned, or the deadline
            with lock:
                if state["finished"]:
                    return
                state["finished"] = True
                now = list(results)
            late = [i for i, r in enumerate(now) if r is None]
            ok = [r is ReadResult.HIT for r in now]
            hits = sum(ok)
            self._counters.add(tenant, lookups=len(ok), hits=hits, misses=len(ok) - hits,
                        bytes_in=sum(r.grant.size for r, good in zip(reserved, ok) if good),
                        read_timeouts=len(late) + now.count(ReadResult.TIMEOUT),
                        read_damaged=now.count(ReadResult.DAMAGED),
                        read_io_errors=now.count(ReadResult.IO_ERROR))
            self._fetches.finish(fetch, ok, late)

        def one(i: int) -> None:
            r = reserved[i]
            try:
                view = self._memory.view(tenant, r.grant.offset, r.grant.size)
                try:
                    result = store.read(tenant.name, r.key, view, deadline)
                finally:
                    view.release()
            except Exception:  # noqa: BLE001 - a bug is a miss, never a stuck request
                logger.exception("ems disk: a read failed")
                result = ReadResult.IO_ERROR
            with lock:
                if state["finished"]:  # answered without it: give its space back
                    self._loop.call_soon(lambda: self._fetches.abort_late(fetch, i))
                    return
                results[i] = result
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                self._loop.call_soon(finish)

        self._loop.call_at(deadline, finish)
        for i in range(len(reserved)):
            self._readers.submit(one, i)

    def count(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
              deadline: Optional[float], done: Callable[[int], None]) -> bool:
        """The leading keys the disk index holds (no I/O); waits for a recovery in
        progress within the deadline."""
        if not self._usable():
            return False
        if self.store.recovering:
            self._after_recovery(self._deadline(deadline),
                                 lambda: done(self.store.leading(tenant.name, keys, sizes)))
            return True
        done(self.store.leading(tenant.name, keys, sizes))
        return True

    # ------------------------------------------------------------ saves
    def stored(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int],
               hashes: Optional[Sequence[Optional[int]]] = None) -> None:
        """Queue the new objects of a save for the disk (admission, then the bounds)."""
        if not self._usable():
            return
        self._quota(tenant)
        second_hit = self.config.admission == "second-hit"
        limit = self.config.queue_bytes
        for key, size in zip(keys, sizes):
            if second_hit and not self._seen_before(tenant.name, key):
                self._counters.add(tenant, not_admitted=1)
                continue
            if self._queued_bytes + size > limit:
                self._counters.add(tenant, queue_dropped=1)
                self._warn("queue", f"{self._queued_bytes} bytes wait for the disk, the "
                                    f"bound (disk.queue): saves are not written to disk "
                                    f"until it drains (counted as queue_dropped)")
                continue
            self._queue.append(_Pending(tenant, key, size))
            self._queued_bytes += size
        self._pump()

    def _seen_before(self, tenant: str, key: str) -> bool:
        seen = self._seen
        if (tenant, key) in seen:
            del seen[(tenant, key)]
            return True
        seen[(tenant, key)] = None
        if len(seen) > _SEEN_KEYS:
            seen.popitem(last=False)
        return False

    def _pump(self) -> None:
        """Start queued writes while the bytes in flight allow (on the loop).

        A value being written is pinned in shared memory, where it cannot be evicted:
        a quarter of a tenant's pool at most is pinned so (and ``disk.inflight`` in
        all), so a disk slower than the saves never makes shared memory refuse them.
        """
        queue, limit = self._queue, self.config.inflight_bytes
        per_tenant = self._inflight_per_tenant
        while queue:
            p = queue[0]
            mine = per_tenant.get(p.tenant.name, 0)
            if self._inflight_bytes and (
                    self._inflight_bytes + p.size > limit or
                    mine and mine + p.size > p.tenant.pool.capacity_bytes // 4):
                break
            queue.popleft()
            self._queued_bytes -= p.size
            if self.store.contains(p.tenant.name, p.key, p.size):
                continue
            pins = p.tenant.pool.acquire([p.key], [p.size], WRITE_OWNER, count=False)
            if not pins:  # evicted (or deleted) before its turn
                self._counters.add(p.tenant, evicted_before_write=1)
                continue
            self._inflight_bytes += p.size
            per_tenant[p.tenant.name] = mine + p.size
            self._writers.submit(self._write, p, pins[0])

    def _write(self, p: _Pending, pin: Pin) -> None:
        """On a writer: the pinned pool bytes to disk; the pin goes back on the loop."""
        try:
            view = self._memory.view(p.tenant, pin.offset, pin.size)
            try:
                result = self.store.write(p.tenant.name, p.key, view)
            finally:
                view.release()
        except Exception:  # noqa: BLE001 - a bug is a write not done, never a stuck pin
            logger.exception("ems disk: a write failed")
            result = WriteResult.IO_ERROR
        self._loop.call_soon(lambda: self._written(p, pin, result))

    def _written(self, p: _Pending, pin: Pin, result: WriteResult) -> None:
        p.tenant.pool.release([pin.token], WRITE_OWNER)
        self._inflight_bytes -= p.size
        self._inflight_per_tenant[p.tenant.name] -= p.size
        if result is WriteResult.WRITTEN or result is WriteResult.EXISTS:
            self._counters.add(p.tenant, writes=1, bytes_out=p.size)
        else:
            self._counters.add(p.tenant, **{f"refused_{result.name.lower()}": 1})
            if result is WriteResult.QUOTA:
                self._warn("quota", f"tenant {p.tenant.name}'s disk share is full and "
                                    f"nothing of it can be evicted: not admitted (counted)")
            elif result is WriteResult.BUDGET:
                self._warn("budget", "the disk's write budget for today is spent "
                                     "(disk.write_budget): not admitted (counted)")
        self._pump()

    # ------------------------------------------------------------ report
    def tenant_report(self, tenant: Tenant) -> Report:
        out = TierCounters.lookups(self._counters.of(tenant))
        out.update(objects=0, used_bytes=0, quota_bytes=None)
        for t in self.store.statistics().tenants:
            if t.tenant == tenant.name:
                out.update(objects=t.objects, used_bytes=t.disk_bytes,
                           quota_bytes=t.quota_bytes)
        return out

    def report(self) -> Report:
        st = self.store.statistics()
        row = dataclasses.asdict(st)
        row.pop("tenants", None)
        c = self._counters.totals()
        row.update(path=self.config.path, admission=self.config.admission,
                   tier={"lookups": c.get("lookups", 0), **TierCounters.lookups(c)},
                   queued_write_bytes=self._queued_bytes,
                   inflight_write_bytes=self._inflight_bytes,
                   admissions_refused={k[len("refused_"):]: v for k, v in c.items()
                                       if k.startswith("refused_")},
                   queue_dropped=c.get("queue_dropped", 0),
                   evicted_before_write=c.get("evicted_before_write", 0),
                   not_admitted=c.get("not_admitted", 0),
                   read_timeouts=c.get("read_timeouts", 0),
                   flushed_on_stop=c.get("flushed_on_stop", 0))
        return row

    # ------------------------------------------------------------ stop
    def close(self) -> None:
        """Flush what shared memory holds and the disk does not (bounded by
        ``flush_on_stop_s``), then checkpoint and mark a clean shutdown."""
        if self._closed:
            return
        self._closed = True
        if self.store.state is DiskState.OK:
            self._flush(time.monotonic() + self.config.flush_on_stop_s)
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._writers.shutdown(wait=True)
        self.store.close(clean=True)
        self._memory.close()

    def _flush(self, deadline: float) -> None:
        """On the loop, which has stopped serving: pin every object the disk lacks,
        write them on the writers, wait until ``deadline``, unpin."""
        self._queue.clear()
        self._queued_bytes = 0
        jobs: list[_Pending] = []
        pins: list[Pin] = []
        for tenant in self._tenants():
            self._quota(tenant)
            pool = tenant.pool
            for key in pool.keys():
                if not isinstance(key, str) or self.store.contains(tenant.name, key):
                    continue
                got = pool.acquire([key], None, WRITE_OWNER, count=False)
                if got:
                    jobs.append(_Pending(tenant, key, got[0].size))
                    pins.append(got[0])

        def write(p: _Pending, pin: Pin) -> bool:
            if time.monotonic() >= deadline:
                return False
            view = self._memory.view(p.tenant, pin.offset, pin.size)
            try:
                return self.store.write(p.tenant.name, p.key, view) in (
                    WriteResult.WRITTEN, WriteResult.EXISTS)
            finally:
                view.release()

        futures = [self._writers.submit(write, p, pin) for p, pin in zip(jobs, pins)]
        done, late = concurrent.futures.wait(futures,
                                             timeout=max(0.0, deadline - time.monotonic()))
        for f in late:
            f.cancel()
        flushed = sum(1 for f in done if not f.cancelled() and f.exception() is None
                      and f.result())
        self._counters.add(flushed_on_stop=flushed)
        if jobs:
            logger.info("ems disk: wrote %d of %d objects of shared memory at stop (%s)",
                        flushed, len(jobs), "all" if flushed == len(jobs) else
                        f"flush_on_stop_s {self.config.flush_on_stop_s:g} s reached")
        self._writers.shutdown(wait=True, cancel_futures=True)
        for p, pin in zip(jobs, pins):
            p.tenant.pool.release([pin.token], WRITE_OWNER)


def start(config: ServerConfig, loop: Loop, tenants: Callable[[], Iterable[Tenant]]
          ) -> DiskTier:
    """The disk tier of a daemon's ``config`` (``disk`` set); RuntimeError when its
    directory is taken by another daemon."""
    disk = config.disk
    assert disk is not None
    try:
        tier = DiskTier(disk, config.capacity_bytes, loop, tenants,
                        reservation_ttl_s=config.reservation_ttl_s)
    except DiskStoreLocked as exc:
        raise RuntimeError(f"disk tier: {exc}") from exc
    logger.info("ems-server: disk tier in %s: capacity %d MiB, admission %s, checkpoint "
                "every %g s", disk.path, disk.capacity_bytes >> 20, disk.admission,
                disk.checkpoint_s)
    return tier
