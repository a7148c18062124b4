"""The daemon's Prometheus exporter (``--metrics-addr 127.0.0.1:9464``; off by default).

The event loop never waits for a scrape::

    scrape (exporter thread) --> LoopSnapshots.get() --wake--> loop builds a report
          |                                                        (fresh dict)
          v
    families built from that frozen report + plain-int latency buckets

Request latencies are counted on the loop into per-verb lists of ints (a bisect, an
increment and an add: 0.35 us per request with the two clock reads, measured with
timeit; prometheus_client's Histogram takes a lock per observation). The exporter
copies a verb's list at once and derives ``_count`` from the buckets, so buckets and
count always agree; ``_sum`` may be one request ahead or behind them.

Metrics (all ``ems_``; counters end in ``_total``; ``tier`` is ``local`` for the host's
shared memory, ``disk`` for the disk tier, ``cluster`` for the cluster tier):

==========================================  ======================  =====================
name                                        labels                  what
==========================================  ======================  =====================
ems_pool_hits_total                         tenant, tier            lookups that hit
ems_pool_misses_total                       tenant, tier, reason    absent, size_mismatch,
                                                                    pending (being written);
                                                                    disk/cluster: absent
ems_pool_hit_bytes_total                    tenant, tier            bytes of the hits
ems_pool_stored_bytes_total                 tenant, tier            bytes committed (disk,
                                                                    cluster: written there)
ems_disk_capacity_bytes, _used_bytes,       -                       the disk tier's size,
ems_disk_objects, _queued_write_bytes,                              use, records, writes
ems_disk_inflight_write_bytes                                       waiting / running
ems_disk_tenant_used_bytes, _objects,       tenant                  a tenant's share of it
ems_disk_tenant_quota_bytes
ems_disk_admissions_refused_total           reason                  no_space, quota, budget,
                                                                    io_error, too_large,
                                                                    queue_full, caller
                                                                    (CcKvOption.write_out)
ems_disk_read_errors_total                  kind                    damaged, io_error,
                                                                    timeout
ems_disk_records_recovered, _recovery_      -                       the last start's
seconds, _records_dropped_damaged_total                             recovery
ems_disk_latency_seconds                    op, quantile            read/write p50, p99
ems_disk_up                                 -                       1 unless the tier is off
ems_disk_unwritten_total                    reason                  new objects not written:
                                                                    queue_full, admission,
                                                                    caller, write_budget,
                                                                    evicted_unwritten, ...
ems_disk_save_waits_total                   -                       saves that waited for
                                                                    the disk's writer
ems_pool_capacity_bytes                     tenant                  usage limit (quota)
ems_pool_arena_bytes                        tenant                  the segment's memory
ems_pool_quota_bytes                        tenant                  quota asked for
ems_pool_used_bytes / _leased_bytes         tenant                  in use / held by leases
ems_pool_live_bytes, _reserved_bytes,       tenant                  used = live + reserved
ems_pool_free_bytes                                                 + leased; free: before
                                                                    the pool must evict
ems_pool_objects, _reserved_objects,        tenant                  objects by state
ems_pool_pinned_objects
ems_pool_leases                             tenant                  connections with a lease
ems_pool_huge_pages                         tenant                  1: its segment is of huge
                                                                    pages (--huge-pages)
ems_pool_evictions_total                    tenant                  LRU evictions
ems_pool_evictions_by_cause_total           tenant, cause           capacity (the policy's
                                                                    victims), fragmentation
                                                                    (their neighbours)
ems_pool_evicted_bytes_total                tenant                  bytes evicted
ems_pool_leases_refused_total               tenant                  no free extent for one
ems_pool_expired_reservations_total         tenant                  reservations timed out
ems_pool_refusals_total                     tenant, reason          full, too_large
ems_limit_refusals_total                    limit                   refusals by limit name
                                                                    (ServerConfig.limits)
ems_tenant_connections                      tenant                  sessions
ems_connections                             -                       all connections
ems_request_duration_seconds                verb                    histogram, on the loop
ems_server_uptime_seconds, ems_server_info  version, protocol       -
ems_control_*                               -                       registry revision,
                                                                    reachable, errors,
                                                                    closed sessions
==========================================  ======================  =====================
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from ems.errors import invalid
from ems.protocol.report import DaemonReport, TenantRow
from ems.server.snapshots import LoopSnapshots
from ems.server.tiers import MetricFamily, Observer, Tier

if TYPE_CHECKING:
    from ems.server.daemon import Daemon

__all__ = ["BUCKETS_S", "MetricsExporter"]

logger = logging.getLogger(__name__)

#: Upper bounds of the latency buckets, seconds (a 1-key request takes ~10-70 us).
BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
             0.1, 1.0)
#: (metric name after ``ems_pool_``, help, the tenant row's figure)
_GAUGES: tuple[tuple[str, str, Callable[[TenantRow], int]], ...] = (
    ("capacity_bytes", "the pool's usage limit (its quota, at most the arena)",
     lambda t: t.capacity_bytes),
    ("arena_bytes", "memory of the tenant's segment", lambda t: t.arena_bytes),
    ("quota_bytes", "the quota asked for (above the arena: limited)", lambda t: t.quota_bytes),
    ("used_bytes", "bytes allocated (objects, reservations, leases)", lambda t: t.used_bytes),
    ("leased_bytes", "bytes held by connections' leases", lambda t: t.leased_bytes),
    ("live_bytes", "bytes of committed objects", lambda t: t.live_bytes),
    ("reserved_bytes", "bytes of reservations being written", lambda t: t.reserved_bytes),
    ("free_bytes", "bytes the pool may allocate before it evicts", lambda t: t.free_bytes),
    ("objects", "committed objects", lambda t: t.objects),
    ("reserved_objects", "reservations being written", lambda t: t.reserved),
    ("pinned_objects", "objects pinned by readers", lambda t: t.pinned),
    ("leases", "connections holding a lease", lambda t: t.leases),
    ("huge_pages", "1: the segment is of huge pages (--huge-pages)",
     lambda t: int(t.huge_pages)))


class _Latency:
    """Per-verb bucket counts, written on the loop, read by the exporter."""

    def __init__(self) -> None:
        self.verbs: dict[str, list] = {}  # verb -> [bucket counts..., +Inf, sum]

    def observe(self, cls: type, seconds: float) -> None:
        row = self.verbs.get(cls.__name__)
        if row is None:
            row = self.verbs[cls.__name__] = [0] * (len(BUCKETS_S) + 1) + [0.0]
        row[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        row[-1] += seconds


class _Collector(Collector):
    def __init__(self, daemon: "Daemon", snapshots: LoopSnapshots, latency: _Latency) -> None:
        self._daemon = daemon
        self._snapshots = snapshots
        self._latency = latency

    def collect(self) -> Iterator[Any]:
        report = self._snapshots.get(timeout_s=1.0)
        if report is not None:
            yield from _pool_families(report)
            members: list[Tier | Observer] = [*self._daemon.tiers, *self._daemon.observers]
            for member in members:  # each tier's own families
                yield from (_prometheus(f) for f in member.metric_families(report))
        yield from self._latency_family()
        sync = self._daemon.control_sync
        if sync is not None:
            yield from _control_families(sync)

    def _latency_family(self) -> Iterator[Any]:
        family = HistogramMetricFamily("ems_request_duration_seconds",
                                       "time the event loop spent on one request",
                                       labels=["verb"])
        for verb, row in sorted(self._latency.verbs.items()):
            counts = list(row[:-1])  # plain ints; a copy taken at once
            total = row[-1]
            cumulative, buckets = 0, []
            for bound, n in zip([*(repr(b) for b in BUCKETS_S), "+Inf"], counts):
                cumulative += n
                buckets.append((bound, cumulative))
            family.add_metric([verb.lower()], buckets, total)
        yield family


def _pool_families(report: DaemonReport) -> Iterator[Any]:
    """The server's and the pools' families, and the lookups of every tier."""
    srv = report.server
    info = InfoMetricFamily("ems_server", "the daemon")
    info.add_metric([], {"version": str(srv.version), "protocol": str(srv.protocol)})
    yield info
    yield GaugeMetricFamily("ems_server_uptime_seconds", "seconds since the start",
                            value=srv.uptime_s)
    yield GaugeMetricFamily("ems_connections", "open connections (all phases)",
                            value=srv.connections)
    limits = CounterMetricFamily("ems_limit_refusals",
                                 "requests and connections refused by a daemon limit",
                                 labels=["limit"])
    for name, n in sorted(srv.refused.items()):
        limits.add_metric([name], n)
    yield limits
    tenants = sorted(report.tenants.items())
    hits = CounterMetricFamily("ems_pool_hits", "lookups that hit", labels=["tenant", "tier"])
    misses = CounterMetricFamily("ems_pool_misses", "lookups that missed, by reason",
                                 labels=["tenant", "tier", "reason"])
    hit_bytes = CounterMetricFamily("ems_pool_hit_bytes", "bytes of the objects hit",
                                    labels=["tenant", "tier"])
    stored = CounterMetricFamily("ems_pool_stored_bytes", "bytes committed",
                                 labels=["tenant", "tier"])
    evictions = CounterMetricFamily("ems_pool_evictions", "objects evicted (LRU)",
                                    labels=["tenant"])
    by_cause = CounterMetricFamily("ems_pool_evictions_by_cause",
                                   "objects evicted: the policy's victims (capacity) or "
                                   "their neighbours, for contiguous space (fragmentation)",
                                   labels=["tenant", "cause"])
    evicted_bytes = CounterMetricFamily("ems_pool_evicted_bytes", "bytes evicted",
                                        labels=["tenant"])
    leases_refused = CounterMetricFamily("ems_pool_leases_refused",
                                         "leases refused: no free extent of a lease's size",
                                         labels=["tenant"])
    expired = CounterMetricFamily("ems_pool_expired_reservations",
                                  "reservations freed after the TTL", labels=["tenant"])
    refusals = CounterMetricFamily("ems_pool_refusals", "reservations refused",
                                   labels=["tenant", "reason"])
    conns = GaugeMetricFamily("ems_tenant_connections", "sessions of the tenant",
                              labels=["tenant"])
    gauges = [(GaugeMetricFamily(f"ems_pool_{name}", doc, labels=["tenant"]), figure)
              for name, doc, figure in _GAUGES]
    for name, t in tenants:
        hits.add_metric([name, "local"], t.hits)
        misses.add_metric([name, "local", "absent"], t.miss_absent)
        misses.add_metric([name, "local", "size_mismatch"], t.miss_size_mismatch)
        misses.add_metric([name, "local", "pending"], t.miss_pending)
        hit_bytes.add_metric([name, "local"], t.hit_bytes)
        stored.add_metric([name, "local"], t.stored_bytes)
        evictions.add_metric([name], t.evictions)
        by_cause.add_metric([name, "capacity"], t.evictions_capacity)
        by_cause.add_metric([name, "fragmentation"], t.evictions_fragmentation)
        evicted_bytes.add_metric([name], t.evicted_bytes)
        leases_refused.add_metric([name], t.leases_refused)
        expired.add_metric([name], t.expired_reservations)
        refusals.add_metric([name, "full"], t.refused_full)
        refusals.add_metric([name, "too_large"], t.refused_too_large)
        conns.add_metric([name], t.connections)
        for family, figure in gauges:
            family.add_metric([name], figure(t))
    for name, t in tenants:  # the tiers beyond shared memory
        for tier, row in t.tiers.beyond_shared_memory():
            hits.add_metric([name, tier], row.hits)
            misses.add_metric([name, tier, "absent"], row.misses)
            hit_bytes.add_metric([name, tier], row.bytes_in)
            stored.add_metric([name, tier], row.bytes_out)
    yield from (hits, misses, hit_bytes, stored, evictions, by_cause, evicted_bytes,
                leases_refused, expired, refusals, conns)
    yield from (family for family, _ in gauges)


def _prometheus(family: MetricFamily) -> Any:
    """A tier's family (plain data) as prometheus_client's."""
    kind = CounterMetricFamily if family.counter else GaugeMetricFamily
    if not family.labels:
        return kind(family.name, family.doc, value=family.samples[0][1])
    out = kind(family.name, family.doc, labels=list(family.labels))
    for labels, value in family.samples:
        out.add_metric(list(labels), value)
    return out


def _control_families(sync: Any) -> Iterator[Any]:
    yield GaugeMetricFamily("ems_control_registry_revision",
                            "registry revision applied (-1: none yet)",
                            value=-1 if sync.revision is None else sync.revision)
    yield GaugeMetricFamily("ems_control_reachable", "1 when the last fetch worked",
                            value=1 if sync.reachable else 0)
    yield CounterMetricFamily("ems_control_fetch_errors", "registry fetches that failed",
                              value=sync.fetch_errors)
    yield CounterMetricFamily("ems_control_report_errors", "reports that failed",
                              value=sync.report_errors)
    yield CounterMetricFamily("ems_control_closed_sessions",
                              "sessions closed for a revoked key or deleted tenant",
                              value=sync.closed_sessions)
    yield GaugeMetricFamily("ems_control_refused_tenants",
                            "tenants of the registry that do not fit on this daemon",
                            value=len(sync.refused))


class MetricsExporter:
    """An HTTP server thread answering ``GET /metrics`` for one daemon."""

    def __init__(self, addr: str, daemon: Any) -> None:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise invalid(f"metrics_addr must be HOST:PORT, got {addr!r}")
        self.host, self.port = host.strip("[]"), int(port)
        self.registry = CollectorRegistry(auto_describe=False)
        self._latency = _Latency()
        self.registry.register(_Collector(daemon, LoopSnapshots(daemon), self._latency))
        daemon.enable_request_timing(self._latency.observe)
        self._server: Optional[Any] = None

    def start(self) -> "MetricsExporter":
        try:
            self._server, _thread = start_http_server(self.port, self.host,
                                                      registry=self.registry)
        except OSError as exc:
            raise invalid(f"metrics_addr {self.host}:{self.port}: cannot listen "
                          f"({exc.strerror})") from exc
        self.port = self._server.server_address[1]
        logger.info("ems-server: Prometheus metrics on http://%s:%d/metrics", self.host,
                    self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
