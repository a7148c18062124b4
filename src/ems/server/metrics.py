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
from typing import TYPE_CHECKING, Any, Iterator, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from ems.errors import invalid
from ems.server.snapshots import LoopSnapshots

if TYPE_CHECKING:
    from ems.server.daemon import Daemon

__all__ = ["BUCKETS_S", "MetricsExporter"]

logger = logging.getLogger(__name__)

#: Upper bounds of the latency buckets, seconds (a 1-key request takes ~10-70 us).
BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
             0.1, 1.0)
_MISS_REASONS = (("absent", "miss_absent"), ("size_mismatch", "miss_size_mismatch"),
                 ("pending", "miss_pending"))
#: (report field, metric name after ``ems_pool_``, help)
_GAUGES = (("capacity_bytes", "capacity_bytes",
            "the pool's usage limit (its quota, at most the arena)"),
           ("arena_bytes", "arena_bytes", "memory of the tenant's segment"),
           ("quota_bytes", "quota_bytes", "the quota asked for (above the arena: limited)"),
           ("used_bytes", "used_bytes", "bytes allocated (objects, reservations, leases)"),
           ("leased_bytes", "leased_bytes", "bytes held by connections' leases"),
           ("live_bytes", "live_bytes", "bytes of committed objects"),
           ("reserved_bytes", "reserved_bytes", "bytes of reservations being written"),
           ("free_bytes", "free_bytes", "bytes the pool may allocate before it evicts"),
           ("objects", "objects", "committed objects"),
           ("reserved", "reserved_objects", "reservations being written"),
           ("pinned", "pinned_objects", "objects pinned by readers"),
           ("leases", "leases", "connections holding a lease"))


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
            yield from self._pool_families(report)
        yield from self._latency_family()
        sync = self._daemon.control_sync
        if sync is not None:
            yield from _control_families(sync)

    def _pool_families(self, report: dict[str, Any]) -> Iterator[Any]:
        srv = report["server"]
        info = InfoMetricFamily("ems_server", "the daemon")
        info.add_metric([], {"version": str(srv["version"]), "protocol": str(srv["protocol"])})
        yield info
        yield GaugeMetricFamily("ems_server_uptime_seconds", "seconds since the start",
                                value=srv["uptime_s"])
        yield GaugeMetricFamily("ems_connections", "open connections (all phases)",
                                value=srv["connections"])
        limits = CounterMetricFamily("ems_limit_refusals",
                                     "requests and connections refused by a daemon limit",
                                     labels=["limit"])
        for name, n in sorted(srv.get("refused", {}).items()):
            limits.add_metric([name], n)
        yield limits
        tenants = report["tenants"]
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
        gauges = {field: GaugeMetricFamily(f"ems_pool_{name}", doc, labels=["tenant"])
                  for field, name, doc in _GAUGES}
        for name, t in sorted(tenants.items()):
            hits.add_metric([name, "local"], t["hits"])
            for reason, field in _MISS_REASONS:
                misses.add_metric([name, "local", reason], t.get(field, 0))
            hit_bytes.add_metric([name, "local"], t.get("hit_bytes", 0))
            stored.add_metric([name, "local"], t.get("stored_bytes", 0))
            evictions.add_metric([name], t["evictions"])
            by_cause.add_metric([name, "capacity"], t.get("evictions_capacity", 0))
            by_cause.add_metric([name, "fragmentation"], t.get("evictions_fragmentation", 0))
            evicted_bytes.add_metric([name], t.get("evicted_bytes", 0))
            leases_refused.add_metric([name], t.get("leases_refused", 0))
            expired.add_metric([name], t["expired_reservations"])
            refusals.add_metric([name, "full"], t.get("refused_full", 0))
            refusals.add_metric([name, "too_large"], t.get("refused_too_large", 0))
            conns.add_metric([name], t["connections"])
            for gauge_name, family in gauges.items():
                family.add_metric([name], t.get(gauge_name, 0) or 0)
        for name, t in sorted(tenants.items()):  # the tiers beyond shared memory
            for tier, row in sorted((t.get("tiers") or {}).items()):
                hits.add_metric([name, tier], row.get("hits", 0))
                misses.add_metric([name, tier, "absent"], row.get("misses", 0))
                hit_bytes.add_metric([name, tier], row.get("bytes_in", 0))
                stored.add_metric([name, tier], row.get("bytes_out", 0))
        yield from (hits, misses, hit_bytes, stored, evictions, by_cause, evicted_bytes,
                    leases_refused, expired, refusals, conns)
        yield from gauges.values()
        disk = report.get("disk")
        if disk:
            yield from _disk_families(disk, tenants)

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


def _disk_families(disk: dict[str, Any], tenants: dict[str, Any]) -> Iterator[Any]:
    """The disk tier's own families (``report()["disk"]``)."""
    for field, doc in (("capacity_bytes", "bytes the disk tier may use"),
                       ("used_bytes", "bytes of region files in use"),
                       ("objects", "records on disk"),
                       ("queued_write_bytes", "bytes waiting to be written"),
                       ("inflight_write_bytes", "bytes being written"),
                       ("records_recovered", "records found by the last start's recovery"),
                       ("recovery_s", "seconds the last start's recovery took")):
        name = "ems_disk_recovery_seconds" if field == "recovery_s" else f"ems_disk_{field}"
        yield GaugeMetricFamily(name, doc, value=disk.get(field) or 0)
    yield GaugeMetricFamily("ems_disk_up", "1 unless the disk tier is off",
                            value=0 if disk.get("state") == "off" else 1)
    yield CounterMetricFamily("ems_disk_records_dropped_damaged",
                              "records dropped as damaged (at recovery or read)",
                              value=disk.get("records_dropped_damaged", 0))
    refused = CounterMetricFamily("ems_disk_admissions_refused",
                                  "objects not written to disk, by reason", labels=["reason"])
    for reason in ("no_space", "quota", "budget", "io_error", "too_large"):
        refused.add_metric([reason], disk.get(f"refused_{reason}", 0))
    refused.add_metric(["queue_full"], disk.get("queue_dropped", 0))
    refused.add_metric(["caller"], disk.get("skipped_caller", 0))
    yield refused
    errors = CounterMetricFamily("ems_disk_read_errors", "disk reads that did not hit",
                                 labels=["kind"])
    for kind, field in (("damaged", "read_damaged"), ("io_error", "read_io_errors"),
                        ("timeout", "read_timeouts")):
        errors.add_metric([kind], disk.get(field, 0))
    yield errors
    latency = GaugeMetricFamily("ems_disk_latency_seconds", "disk I/O latency",
                                labels=["op", "quantile"])
    for op in ("read", "write"):
        for q in ("p50", "p99"):
            latency.add_metric([op, q], disk.get(f"{op}_latency_{q}_s") or 0.0)
    yield latency
    per = {f: GaugeMetricFamily(f"ems_disk_tenant_{f}", doc, labels=["tenant"])
           for f, doc in (("used_bytes", "a tenant's bytes on disk"),
                          ("objects", "a tenant's records on disk"),
                          ("quota_bytes", "a tenant's disk share"))}
    for name, t in sorted(tenants.items()):
        row = (t.get("tiers") or {}).get("disk")
        if row:
            for f, family in per.items():
                family.add_metric([name], row.get(f) or 0)
    yield from per.values()


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
