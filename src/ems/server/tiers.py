"""The tier seam: what lies beyond a host's shared memory, and how the daemon asks it.

The tenant's pool in shared memory (``ems.pool.core``) is the tier every request
starts and ends in: clients copy only to and from it. Other tiers (the local disk,
``ems.server.disk_tier``; the Valkey Cluster shared by every host,
``ems.server.cluster_tier``) are engines behind one ``ems.server.tier_driver.
TierDriver``, which implements :class:`Tier` and keeps their books (workers,
deadlines, fetches, pins, write-out bounds, counters); the request handlers
(``ems.server.handlers``) call it at the points where a request can go beyond
shared memory:

==============  ==============================================  ======================
point           hook                                            default (not handled)
==============  ==============================================  ======================
load misses     :meth:`Tier.fill` brings keys into shared       ``False``
                memory, then the handler pins them
exists misses   :meth:`Tier.count` counts leading keys present  ``False``
new objects     :meth:`Tier.stored` (write-behind, spill)       nothing
save beyond     :meth:`Tier.save_through` (``write_rcache``     ``False``: stored
shared memory   False: that tier only, no local copy)           locally as usual
an eviction     :meth:`Tier.evicted`                            nothing
a save waits    :meth:`Tier.wait_written` (shared memory full   ``False``: evict
for the writer  of objects not written out yet)                 one of them
a session ends  :meth:`Tier.closed`                             nothing
a tenant is     :meth:`Tier.removed` (deleted by the control     nothing
deleted         plane: its memory and queued work let go)
the report      :meth:`Tier.report`, :meth:`Tier.tenant_report` ``None``
metrics         :meth:`Tier.metric_families` (its own families)  none
stop            :meth:`Tier.close`                              nothing
==============  ==============================================  ======================

Optional hooks return neutral results, and capabilities are declared as class
attributes (vLLM's connector base does the same: ``SupportsHMA``): :attr:`Tier.local`
(the tier counts as this host's, for ``read_local_only`` and a local ``exists``),
:attr:`Tier.takes_saves_through`. Lookups go shared memory, then the tiers in their
order (disk before cluster); each tier fills shared memory with the leading keys it
has, the handler pins them and hands what is still missing to the next one.

What only watches the pools (KV events) is an :class:`Observer`, told of the same
new objects and evictions, and never asked to load, count or save.

A tier never answers a client, never touches a session's state and never imports
another tier: it is told what to do and calls ``done`` on the event loop (through
:class:`Loop`) when its part is over. It may use its tenant's pool with owners of its
own (a fetch's reservations, the pins of values being written out).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable, ClassVar, NamedTuple, Optional, Protocol, Sequence

from ems.protocol.report import DaemonReport, TierRow, WireRow
from ems.server.session import Session
from ems.server.tenants import Tenant

__all__ = ["Extent", "Loop", "MetricFamily", "Observer", "Tier", "TierCounters",
           "TierEvents"]


@dataclasses.dataclass(frozen=True)
class MetricFamily:
    """A family of Prometheus samples that a tier or observer exports, as plain data
    (``ems.server.metrics`` hands it to prometheus_client, which the daemon imports only
    with ``--metrics-addr``)."""

    #: the full name (``ems_disk_used_bytes``; a counter's without ``_total``)
    name: str
    doc: str
    counter: bool = False
    labels: tuple[str, ...] = ()
    #: (label values, value)
    samples: list[tuple[tuple[str, ...], float]] = dataclasses.field(default_factory=list)

    def add(self, labels: Sequence[str], value: float) -> None:
        self.samples.append((tuple(labels), value))


class Loop(Protocol):
    """The daemon's event loop, as a tier sees it."""

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the event loop soon (callable from any thread)."""

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the event loop at monotonic time ``when`` (any thread)."""


class Extent(NamedTuple):
    """A range of a tenant's shared memory: where a value's bytes are (a save written
    through a tier: ``Tier.save_through``)."""

    offset: int
    size: int


class Tier:
    """A tier below or beside shared memory. Every hook is optional; the defaults do
    nothing and report "not handled" (see the module docstring)."""

    #: its name in reports and metrics (``disk``, ``cluster``)
    name: ClassVar[str] = "tier"
    #: counts as this host's own: consulted by ``read_local_only`` loads and by a
    #: local ``exists``
    local: ClassVar[bool] = False
    #: takes saves with ``write_rcache`` False (:meth:`save_through`)
    takes_saves_through: ClassVar[bool] = False
    #: wants :meth:`stored` after each commit or carve of new keys
    wants_stored: ClassVar[bool] = False
    #: wants :meth:`evicted` for each object the pool evicts
    wants_evicted: ClassVar[bool] = False

    def fill(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
             deadline: Optional[float], done: Callable[[], None]) -> bool:
        """Bring the leading run of ``keys`` that this tier holds into ``tenant``'s pool
        (committed there), then call ``done()`` on the loop, whatever came of it, by
        ``deadline`` (monotonic seconds; None: the tier's own bound). False: nothing
        to do here (``done`` is not called)."""
        return False

    def count(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
              deadline: Optional[float], done: Callable[[int], None]) -> bool:
        """Count the leading run of ``keys`` present in this tier; ``done(n)`` on the
        loop by ``deadline``. False: not handled (``done`` is not called)."""
        return False

    def stored(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int],
               hashes: Optional[Sequence[Optional[int]]] = None, *,
               write_out: bool = True) -> None:
        """New objects were committed in ``tenant``'s pool (a save's NEW keys);
        ``hashes``: the engine's block hash of each key, where the save carried them
        (KV events); ``write_out`` False: the caller asked that they stay in shared
        memory (``CcKvOption.write_out``): not written out, counted."""

    def save_through(self, tenant: Tenant, keys: Sequence[str], extents: Sequence[Extent],
                     deadline: Optional[float], done: Callable[[list[bool]], None],
                     hashes: Optional[Sequence[Optional[int]]] = None) -> bool:
        """Store values that a client wrote into ``extents`` of the pool in this tier
        only; ``done(ok per key)`` on the loop when they are (or are not) stored, after
        which the extents are given back. False: not handled (stored locally).
        ``hashes``: the engine's block hash of each key, where the save carried them
        (KV events)."""
        return False

    def evicted(self, tenant: Tenant, key: str, size: int) -> None:
        """``key`` left ``tenant``'s pool to make room for another."""

    def wait_written(self, tenant: Tenant, since: float, until: Optional[float],
                     then: Callable[[], None]) -> bool:
        """A save found ``tenant``'s pool full of objects this tier has not written yet
        (``Pool.mark_unwritten``): call ``then()`` on the loop when one of its writes
        of the tenant ended, or when the save has waited long enough since ``since``
        (monotonic s), and by ``until`` at the latest (None: no bound of the save's
        own). False: nothing to wait for (``then`` is not called)."""
        return False

    def closed(self, session: Session) -> None:
        """A session ended (its pins, reservations and lease are gone already)."""

    def removed(self, tenant: Tenant) -> None:
        """``tenant`` was deleted: its sessions are closed, and its memory's descriptor
        is closed right after this returns (on the loop). Let go of every mapping of its
        memory (``ems.server.memory.SegmentMaps.forget``) and of what is queued for it;
        work in flight may end as usual (a mapping goes with its last view)."""

    def report(self) -> Optional[WireRow]:
        """The tier's part of the daemon's report (``DaemonReport.<name>``)."""
        return None

    def tenant_report(self, tenant: Tenant) -> Optional[TierRow]:
        """The tier's counters of one tenant (``tenants[name].tiers.<tier name>``)."""
        return None

    def metric_families(self, report: DaemonReport) -> list[MetricFamily]:
        """The tier's own Prometheus families, from ``report`` alone (a snapshot: this
        runs on the exporter's thread). The lookups every tier has are the exporter's
        (``ems_pool_hits{tier=...}``, from ``tenant_report``)."""
        return []

    def close(self) -> None:
        """The daemon stops (after the last request was answered)."""


class Observer:
    """Watches what shared memory stores and evicts (KV events: ``ems.server.
    events_observer``): holds no bytes and handles no load, count or save, so the
    handlers never walk it as a tier. Every hook is optional (neutral defaults)."""

    #: its name in the daemon's report
    name: ClassVar[str] = "observer"

    def stored(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int],
               hashes: Optional[Sequence[Optional[int]]] = None) -> None:
        """A save's NEW keys were committed in ``tenant``'s pool (``hashes``: the
        engine's block hash of each key, where the save carried them)."""

    def evicted(self, tenant: Tenant, key: str, size: int) -> None:
        """``key`` left ``tenant``'s pool to make room for another."""

    def report(self) -> Optional[WireRow]:
        """Its part of the daemon's report (``DaemonReport.<name>``)."""
        return None

    def metric_families(self, report: DaemonReport) -> list[MetricFamily]:
        """Its own Prometheus families (see :meth:`Tier.metric_families`)."""
        return []


class TierEvents(Protocol):
    """What a tier beyond shared memory tells KV events (``ems.server.events_observer``)
    of its own stores and removals, by tenant name and key, from any thread."""

    def tier_stored(self, tenant: str, keys: Sequence[str], tier: str,
                    hashes: Optional[Sequence[Optional[int]]] = None) -> None:
        """``keys`` are now held by ``tier`` (an ``ems.server.kv_events.MEDIUMS`` name);
        ``hashes``: their engine block hashes where the tier got them with the save (a
        save written through, never in shared memory); the others' are the ones their
        save into shared memory brought."""

    def tier_removed(self, tenant: str, keys: Sequence[str], tier: str, *,
                     any_writer: bool = False) -> None:
        """``keys`` left ``tier`` (evicted, dropped, deleted). ``any_writer``: the tier
        is shared with other hosts and found these keys missing, whoever wrote them: a
        key this host never announced there is not an untracked removal."""

    def held(self, tier: str) -> dict[str, list[tuple[str, int]]]:
        """tenant -> (key, engine hash) of the keys announced in ``tier`` and not
        removed since (what the disk keeps across a restart)."""


class TierCounters:
    """A tier's counters, in all and per tenant (updated by its workers and its loop
    side: one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: collections.Counter[str] = collections.Counter()
        self._per_tenant: dict[str, collections.Counter[str]] = {}

    def add(self, tenant: Optional[Tenant] = None, **counts: int) -> None:
        # (a loop, not Counter.update: its check that ``counts`` is a Mapping, an ABC,
        # cost more than the adding; workers count each batch they write)
        with self._lock:
            whole = self._all
            row = None if tenant is None else self._per_tenant.get(tenant.name)
            if row is None and tenant is not None:
                row = self._per_tenant[tenant.name] = collections.Counter()
            for name, n in counts.items():
                whole[name] += n
                if row is not None:
                    row[name] += n

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._all)

    def of(self, tenant: Tenant) -> dict[str, int]:
        with self._lock:
            return dict(self._per_tenant.get(tenant.name, {}))
