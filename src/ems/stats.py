"""``ems stats`` / ``ems-server stats``: the daemon's counters as a table, or as JSON
(``--json``). A client of the daemon (outside ``ems.server``, which never imports the
client).

It opens an admin session, which the daemon grants without credentials to its own
user and to root (it checks the peer's uid) and which sees every tenant. Tenants read
their own counters through ``ContextCaching.statistics()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence, Union

from ems.errors import EmsException
from ems.protocol.report import ClusterReport, DaemonReport, DiskReport, Wire, hit_rate

__all__ = ["format_report", "main"]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _memory_lines(report: DaemonReport) -> list[str]:
    """Where each tenant's bytes are (used = live + reserved + leased), why objects
    went, and the pages of its memory (``--huge-pages``; a daemon older than these
    fields sends none of them: they read as 0, and 4 KiB pages)."""
    rows = [("tenant", "live", "reserved", "leased", "free", "evicted capacity",
             "evicted fragmentation", "leases refused", "pages")]
    for name, t in sorted(report.tenants.items()):
        rows.append((name, _size(t.live_bytes), _size(t.reserved_bytes),
                     _size(t.leased_bytes), _size(t.free_bytes), str(t.evictions_capacity),
                     str(t.evictions_fragmentation), str(t.leases_refused),
                     "huge" if t.huge_pages else "4 KiB"))
    return ["memory:"] + _table(rows)


def format_report(report: Union[DaemonReport, Wire]) -> str:
    """The human-readable table of a statistics report (typed, or its wire form)."""
    if not isinstance(report, DaemonReport):
        report = DaemonReport.from_wire(report)
    srv = report.server
    lines = [(
        f"ems-server {srv.version} on {srv.socket}: pid {srv.pid}, "
        f"up {srv.uptime_s:.0f} s, {srv.connections} connection(s), capacity "
        f"{_size(srv.capacity_bytes)}, {srv.tenants} tenant(s), anonymous "
        f"{'on' if srv.anonymous else 'off'}")]
    head = ("tenant", "capacity", "used", "objects", "reserved", "pinned", "hit rate",
            "evictions", "expired", "conns")
    rows = [head]
    for name, t in sorted(report.tenants.items()):
        rows.append((name, _size(t.capacity_bytes), _size(t.used_bytes), str(t.objects),
                     str(t.reserved), str(t.pinned), f"{100 * t.hit_rate:.1f}%",
                     str(t.evictions), str(t.expired_reservations), str(t.connections)))
    lines += _table(rows)
    lines += _memory_lines(report)
    if srv.refused:
        lines.append("refused by limits: " + ", ".join(
            f"{name} {count}" for name, count in sorted(srv.refused.items())))
    if not srv.accepting:
        lines.append("not accepting connections now (out of file descriptors; backing off)")
    if report.disk is not None:
        lines += _disk_lines(report, report.disk)
    if report.cluster is not None:
        lines += _cluster_lines(report, report.cluster)
    return "\n".join(lines)


def _disk_lines(report: DaemonReport, disk: DiskReport) -> list[str]:
    """The disk tier: its state, per tenant, and what it refused or recovered."""
    t = disk.tier
    lines = [f"disk {disk.path}: {disk.state}, {_size(disk.used_bytes)} of "
             f"{_size(disk.capacity_bytes)}, {disk.objects} object(s), admission "
             f"{disk.admission}; {t.hits} hit(s) of {t.lookups} lookup(s) "
             f"({100 * t.hit_rate:.1f}%), {_size(t.bytes_in)} read, "
             f"{_size(t.bytes_out)} written; writes queued "
             f"{_size(disk.queued_write_bytes)}, in flight "
             f"{_size(disk.inflight_write_bytes)}",
             f"  recovery: {disk.records_recovered} record(s) in "
             f"{disk.recovery_s:.3f} s ({'scan skipped' if disk.scan_skipped else 'scanned'}"
             f"), {disk.records_dropped_damaged} dropped as damaged"
             + (f", {disk.announced_recovered} announced to KV events"
                if disk.announced_recovered else "")
             + f"; {disk.checkpoints} checkpoint(s)"]
    unwritten = {k: v for k, v in disk.unwritten.items() if v}
    if unwritten or disk.save_waits:  # (an older daemon sends no such counters)
        lines.append("  not written: " + (", ".join(
            f"{k} {v}" for k, v in sorted(unwritten.items())) or "none") +
            f"; {disk.save_waits} save(s) waited for the writer")
    elif disk.admissions_refused or disk.queue_dropped:
        parts = [f"{k} {v}" for k, v in sorted(disk.admissions_refused.items())]
        if disk.queue_dropped:
            parts.append(f"queue_full {disk.queue_dropped}")
        lines.append("  not admitted: " + ", ".join(parts))
    rows: list[tuple[str, ...]] = [("tenant", "disk used", "objects", "quota", "hits",
                                    "misses", "bytes in", "bytes out")]
    for name, row in sorted(report.tenants.items()):
        d = row.tiers.disk
        if d is not None:
            rows.append((name, _size(d.used_bytes), str(d.objects),
                         _size(d.quota_bytes) if d.quota_bytes is not None else "-",
                         str(d.hits), str(d.misses), _size(d.bytes_in), _size(d.bytes_out)))
    return lines + (_table(rows) if len(rows) > 1 else [])


def _table(rows: list) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])
            for r in rows]


def _cluster_lines(report: DaemonReport, cluster: ClusterReport) -> list[str]:
    """Per tier (local pool, cluster) and per Valkey node."""
    t = cluster.tier
    hits = sum(r.hits for r in report.tenants.values())
    misses = sum(r.misses for r in report.tenants.values())
    lines = [f"cluster {','.join(cluster.seeds)} ({'TLS' if cluster.tls else 'TCP'}): "
             f"{cluster.state}; redirects {cluster.redirects}"]
    rows: list[tuple[str, ...]] = [("tier", "lookups", "hits", "misses", "hit rate",
                                    "bytes in", "bytes out", "p50 ms", "p99 ms",
                                    "write-behind")]
    rows.append(("local", str(hits + misses), str(hits), str(misses),
                 f"{100 * hit_rate(hits, misses):.1f}%", "-", "-", "-", "-", "-"))
    rows.append(("cluster", str(t.lookups), str(t.hits), str(t.misses),
                 f"{100 * t.hit_rate:.1f}%", _size(t.bytes_in), _size(t.bytes_out),
                 f"{t.latency_p50_ms:.2f}", f"{t.latency_p99_ms:.2f}",
                 f"{_size(t.write_behind_pending_bytes)} pending, "
                 f"{t.write_behind_dropped} dropped"))
    lines += _table(rows)
    rows = [("node", "slots", "state", "ops", "errors", "skipped", "bytes in", "bytes out",
             "last error")]
    for n in cluster.nodes:
        rows.append((n.node, str(n.slots), n.state, str(n.ops), str(n.errors), str(n.skipped),
                     _size(n.bytes_in), _size(n.bytes_out), n.last_error[:40] or "-"))
    return lines + _table(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ems.client.remote import server_report
    from ems.config import PoolSettings

    parser = argparse.ArgumentParser(
        prog="ems-server stats", description="Print the counters of a running ems-server.")
    parser.add_argument("--socket-dir", default=None,
                        help="directory of ems.sock (default: $EMS_SOCKET_DIR or /dev/shm/ems)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout-s", type=float, default=3.0,
                        help="give up after this long (default 3)")
    args = parser.parse_args(argv)
    try:  # the SDK's own rule for where the socket is (EMS_SOCKET_DIR or the default)
        settings = PoolSettings.from_env()
        if args.socket_dir:
            settings = dataclasses.replace(settings, socket_dir=args.socket_dir)
        report = server_report(settings.socket_path, args.timeout_s)
    except EmsException as exc:
        print(f"ems-server stats: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(format_report(report))
    return 0
