"""The daemon's disk tier: shared memory backed by region files on a local SSD.

With ``--disk DIR`` every tenant's pool gets a second, larger tier on the host's
disk (``ems.disk.DiskStore``: append-only region files with checksummed records and
an index checkpointed every ``checkpoint_s``). The SDK's calls do not change:

* **Saves.** An object committed in shared memory is queued to be written to disk
  (``admission = "all"``; ``"second-hit"``: only a key saved again after it left shared
  memory, i.e. one worth keeping). A worker writes a save's objects together from the
  pool memory, pinned meanwhile, packed into the store's write buffers (many records
  per I/O, gathered where they lie), so the write costs no copy beyond the disk's own.
  Writes in flight are
  bounded (``inflight``, 64 MiB), and so are the bytes waiting (``queue``, 1 GiB; past
  it a save is not written to disk, counted as ``queue_dropped``). Objects waiting are
  evicted from shared memory only after every object already on disk, and a save that
  finds shared memory full of them waits up to ``save_wait_ms`` for the writer
  (back-pressure: ``ems.server.tier_driver``; what is not written out anyway is
  counted by reason, ``unwritten``).
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

This module is the engine only (``ems.server.tier_driver.Engine``: look up, read,
write, report); the tier driver keeps the books around it: the workers (reads and
writes apart), the queue and the in-flight bounds, the pins, the fetches and their
de-duplication, the deadlines and the counters.

Deadlines: a load's disk reads get the request's deadline (80% of what is left,
``ems.server.handlers.BUDGET_SHARE``), never more than half the reservation TTL. A
read checks the deadline between chunks (``ems.disk``) and says TIMEOUT; a read still
running at the deadline keeps its reservation until it returns and is then aborted,
so no byte reaches the pool space of a key after the key was aborted, and the
client's copy starts only from committed, checksummed bytes. A load or ``exists``
that arrives while the store recovers waits for the recovery within its own deadline
(on a worker, never on the loop).

Faults: ENOSPC or a tenant's disk share full -> nothing more admitted (one warning, a
counter), shared memory keeps serving; EIO on a read -> a miss, counted; the
directory removed or unwritable -> the store turns off (one error line) and the
daemon keeps serving from shared memory.

KV events (``--kv-events``): a record written -> ``BlockStored``, a key that left the
disk (its region evicted, its record damaged or its file lost) -> ``BlockRemoved``,
both with medium ``ems-disk`` and for keys whose save brought the engine's hashes
(``ems.server.tiers.TierEvents``; the store names the keys an evicted region held).
After a restart (``disk.announce_recovered``, on by default) ``BlockStored`` of the
recovered records whose hash the side file ``DIR/kv-hashes`` kept
(``ems.server.disk_announce``: written every checkpoint interval and at a clean stop).

Stop: SIGTERM writes the objects of shared memory that are not on disk yet, for at
most ``flush_on_stop_s``, then checkpoints and marks a clean shutdown, so the next
start skips the scan and finds everything that fitted on the disk.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, ClassVar, Iterable, Optional, Sequence

from ems.disk import DiskSettings, DiskState, DiskStore, DiskStoreLocked, ReadResult, WriteResult
from ems.protocol.report import DaemonReport, DiskReport, DiskTenantRow, TierTotals
from ems.server import disk_announce
from ems.server.config import ANONYMOUS, DiskConfig, ServerConfig
from ems.server.tenants import Tenant
from ems.server.tier_driver import (
    HELD,
    WRITTEN,
    AdmitAll,
    DriverSettings,
    DriverStatistics,
    Engine,
    ReadOutcome,
    SecondHit,
    Sources,
    Target,
    TierDriver,
    Written,
)
from ems.server.tiers import Loop, MetricFamily, TierEvents

__all__ = ["DiskEngine", "start"]

logger = logging.getLogger(__name__)

#: the disk's name in KV events (``ems.server.kv_events.MEDIUMS``)
MEDIUM = "ems-disk"
_READ = {ReadResult.HIT: ReadOutcome.HIT, ReadResult.TIMEOUT: ReadOutcome.TIMEOUT,
         ReadResult.DAMAGED: ReadOutcome.DAMAGED, ReadResult.IO_ERROR: ReadOutcome.IO_ERROR}
_WARN = {WriteResult.QUOTA: "a tenant's disk share is full and nothing of it can be "
                            "evicted: not admitted (counted)",
         WriteResult.BUDGET: "the disk's write budget for today is spent "
                             "(disk.write_budget): not admitted (counted)"}

#: the driver's outcome of each of the store's results
_OUTCOME = {r: WRITTEN if r is WriteResult.WRITTEN else HELD if r is WriteResult.EXISTS
            else Written(False, r.value, _WARN.get(r)) for r in WriteResult}


class DiskEngine(Engine):
    """See the module docstring: a ``DiskStore`` behind the tier driver."""

    name: ClassVar[str] = "disk"
    local: ClassVar[bool] = True
    #: a save's keys reach the store together: it packs them into write buffers, many
    #: records per I/O (``DiskStore.write_batch``)
    batch_writes: ClassVar[bool] = True

    def __init__(self, config: DiskConfig, pool_capacity_bytes: int,
                 events: Optional[TierEvents] = None) -> None:
        self.config = config
        self.events = events
        self.store = DiskStore(DiskSettings(
            path=config.path, capacity_bytes=config.capacity_bytes,
            checkpoint_s=config.checkpoint_s,
            write_budget_bytes_per_day=config.write_budget_bytes_per_day,
            write_buffer_bytes=config.write_buffer_bytes, io_delay_s=config.io_delay_ms / 1000),
            on_removed=None if events is None else self._removed)
        self.store.open()  # recovery runs in the background from here
        self.admission = SecondHit() if config.admission == "second-hit" else AdmitAll()
        self._pool_capacity = max(1, pool_capacity_bytes)
        #: a save larger than one write buffer is written in write buffers side by
        #: side, one per writer, instead of one buffer after the other
        self.write_chunk_bytes = config.write_buffer_bytes
        #: a reader's share of a fetch is a read chunk at least (``Engine``'s doc)
        self.read_share_bytes = self.store.settings.chunk_bytes
        #: announces what recovery found and keeps the engine's hashes across restarts
        #: (``disk.announce_recovered``; ``ems.server.disk_announce``)
        self.keeper: Optional[disk_announce.HashKeeper] = None
        if events is not None and config.announce_recovered:
            self.keeper = disk_announce.HashKeeper(self.store, config.path, events, MEDIUM,
                                                   config.checkpoint_s)

    def usable(self) -> bool:
        return self.store.state is not DiskState.OFF

    def ready(self) -> bool:
        return not self.store.recovering

    def wait_ready(self, timeout_s: float) -> None:
        self.store.wait_recovered(timeout_s)

    def opened(self, tenant: Tenant) -> None:
        """Give the store ``tenant``'s disk share: its ``[disk.quotas]`` entry, else
        its share of the pools' memory applied to the disk's capacity."""
        key = tenant.spec.access_id if tenant.spec.access_id is not None else ANONYMOUS
        share = self.config.quotas_bytes.get(key)
        if share is None:
            share = int(self.config.capacity_bytes * min(1.0, tenant.segment_size /
                                                         self._pool_capacity))
        self.store.set_quota(tenant.name, share)

    def lookup(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]]
               ) -> list[int]:
        """The leading keys the disk index holds, with their sizes (no I/O)."""
        return self.store.leading(tenant.name, keys, sizes)

    def read(self, tenant: Tenant, target: Target, deadline: float) -> ReadOutcome:
        return self.read_batch(tenant, [target], deadline)[0]

    def read_batch(self, tenant: Tenant, targets: Sequence[Target], deadline: float
                   ) -> list[ReadOutcome]:
        """A reader's share of a fetch: records written back to back (a save's blocks)
        come in one transfer (``DiskStore.read_batch``)."""
        results = self.store.read_batch(tenant.name, [(t.key, t.memory) for t in targets],
                                        deadline)
        return [_READ.get(r, ReadOutcome.MISS) for r in results]

    def write(self, tenant: Tenant, source: Target, deadline: Optional[float]) -> Written:
        return self.write_batch(tenant, Sources([source.key], [source.memory]), deadline)[0]

    def write_batch(self, tenant: Tenant, sources: Sources, deadline: Optional[float]
                    ) -> list[Written]:
        """The sources packed into the store's write buffers; ``BlockStored`` for the
        keys whose batch's write returned (the meaning of WRITTEN, as for one record)."""
        keys = sources.keys
        results = self.store.write_batch(tenant.name, keys, sources.memories)
        if self.events is not None:
            stored = (keys if results.count(WriteResult.WRITTEN) == len(results) else
                      [k for k, r in zip(keys, results) if r is WriteResult.WRITTEN])
            if stored:
                self.events.tier_stored(tenant.name, stored, MEDIUM)
                if self.keeper is not None:
                    self.keeper.changed()
        return list(map(_OUTCOME.__getitem__, results))

    def _removed(self, tenant: str, keys: Sequence[str]) -> None:
        assert self.events is not None
        self.events.tier_removed(tenant, keys, MEDIUM)
        if self.keeper is not None:
            self.keeper.changed()

    def tenant_report(self, tenant: Tenant, books: DriverStatistics) -> DiskTenantRow:
        for t in self.store.statistics().tenants:
            if t.tenant == tenant.name:
                return books.tier_row(DiskTenantRow, objects=t.objects,
                                      used_bytes=t.disk_bytes, quota_bytes=t.quota_bytes)
        return books.tier_row(DiskTenantRow)

    def report(self, books: DriverStatistics) -> DiskReport:
        store = dataclasses.asdict(self.store.statistics())
        del store["tenants"]  # the tenants' rows are theirs (tenant_report)
        store.update(read_timeouts=books.read_timeouts)  # the driver's deadlines
        return DiskReport(
            **store, path=self.config.path, admission=self.config.admission,
            tier=books.tier_row(TierTotals, lookups=books.lookups),
            queued_write_bytes=books.queued_bytes, inflight_write_bytes=books.inflight_bytes,
            admissions_refused=books.refused, queue_dropped=books.dropped,
            evicted_before_write=books.evicted_before_write,
            unwritten=books.unwritten, save_waits=books.save_waits,
            not_admitted=books.not_admitted, skipped_caller=books.skipped_caller,
            skipped_forgotten=books.skipped_forgotten, flushed_on_stop=books.flushed_on_stop,
            announced_recovered=0 if self.keeper is None else self.keeper.announced)

    def metric_families(self, report: DaemonReport) -> list[MetricFamily]:
        """``ems_disk_*`` (see ``ems.server.metrics``), from ``report.disk`` and the
        tenants' disk rows."""
        disk = report.disk
        if disk is None:
            return []
        out = [MetricFamily(name, doc, samples=[((), value or 0)]) for name, doc, value in (
            ("ems_disk_capacity_bytes", "bytes the disk tier may use", disk.capacity_bytes),
            ("ems_disk_used_bytes", "bytes of region files in use", disk.used_bytes),
            ("ems_disk_objects", "records on disk", disk.objects),
            ("ems_disk_queued_write_bytes", "bytes waiting to be written",
             disk.queued_write_bytes),
            ("ems_disk_inflight_write_bytes", "bytes being written", disk.inflight_write_bytes),
            ("ems_disk_records_recovered", "records found by the last start's recovery",
             disk.records_recovered),
            ("ems_disk_recovery_seconds", "seconds the last start's recovery took",
             disk.recovery_s),
            ("ems_disk_up", "1 unless the disk tier is off", 0 if disk.state == "off" else 1))]
        out.append(MetricFamily("ems_disk_records_dropped_damaged",
                                "records dropped as damaged (at recovery or read)", counter=True,
                                samples=[((), disk.records_dropped_damaged)]))
        refused = MetricFamily("ems_disk_admissions_refused",
                               "objects not written to disk, by reason", counter=True,
                               labels=("reason",))
        for reason, n in (("no_space", disk.refused_no_space), ("quota", disk.refused_quota),
                          ("budget", disk.refused_budget), ("io_error", disk.refused_io_error),
                          ("too_large", disk.refused_too_large),
                          ("queue_full", disk.queue_dropped), ("caller", disk.skipped_caller)):
            refused.add([reason], n)
        errors = MetricFamily("ems_disk_read_errors", "disk reads that did not hit",
                              counter=True, labels=("kind",))
        for kind, n in (("damaged", disk.read_damaged), ("io_error", disk.read_io_errors),
                        ("timeout", disk.read_timeouts)):
            errors.add([kind], n)
        latency = MetricFamily("ems_disk_latency_seconds", "disk I/O latency",
                               labels=("op", "quantile"))
        for op, q, seconds in (("read", "p50", disk.read_latency_p50_s),
                               ("read", "p99", disk.read_latency_p99_s),
                               ("write", "p50", disk.write_latency_p50_s),
                               ("write", "p99", disk.write_latency_p99_s)):
            latency.add([op, q], seconds or 0.0)
        unwritten = MetricFamily(
            "ems_disk_unwritten", "new objects of shared memory not written to disk, by "
            "reason (evicted_unwritten: evicted before their write)", counter=True,
            labels=("reason",))
        for reason, n in sorted(disk.unwritten.items()):
            unwritten.add([reason], n)
        waits = MetricFamily("ems_disk_save_waits", "saves that waited for the disk's "
                             "writer (shared memory full of unwritten objects)", counter=True,
                             samples=[((), disk.save_waits)])
        out += [refused, errors, latency, unwritten, waits]
        per = [MetricFamily(f"ems_disk_tenant_{name}", doc, labels=("tenant",))
               for name, doc in (("used_bytes", "a tenant's bytes on disk"),
                                 ("objects", "a tenant's records on disk"),
                                 ("quota_bytes", "a tenant's disk share"))]
        for name, t in sorted(report.tenants.items()):
            row = t.tiers.disk
            if row is not None:
                for family, value in zip(per, (row.used_bytes, row.objects, row.quota_bytes)):
                    family.add([name], value or 0)
        return out + per

    def close(self) -> None:
        """Write the side file of hashes (when its keeper got that far), checkpoint
        and mark a clean shutdown (after the driver's flush)."""
        if self.keeper is not None:
            self.keeper.close()
        self.store.close(clean=True)


def start(config: ServerConfig, loop: Loop, tenants: Callable[[], Iterable[Tenant]],
          events: Optional[TierEvents] = None,
          clock: Callable[[], float] = time.monotonic) -> TierDriver:
    """The disk tier of a daemon's ``config`` (``disk`` set), telling ``events`` (KV
    events) what it stores and removes, its deadlines on ``clock`` (the daemon's);
    RuntimeError when its directory is taken by another daemon."""
    disk = config.disk
    assert disk is not None
    try:
        engine = DiskEngine(disk, config.capacity_bytes, events)
    except DiskStoreLocked as exc:
        raise RuntimeError(f"disk tier: {exc}") from exc
    tier = TierDriver(engine, loop, DriverSettings(
        read_workers=disk.io_threads, write_workers=disk.io_threads,
        max_op_s=config.reservation_ttl_s / 2, inflight_bytes=disk.inflight_bytes,
        tenant_share=0.25, queue_bytes=disk.queue_bytes, bound_setting="disk.queue",
        save_wait_s=disk.save_wait_ms / 1000,
        flush_on_stop_s=disk.flush_on_stop_s), tenants, clock=clock)
    logger.info("ems-server: disk tier in %s: capacity %d MiB, admission %s, checkpoint "
                "every %g s", disk.path, disk.capacity_bytes >> 20, disk.admission,
                disk.checkpoint_s)
    return tier
