"""Leak checks for the teardown of a test's pool: what a fixture must find when the
test is done with it.

Nothing a finished request took may stay behind: no pins (a reader that never gave its
object back), no reservations (a writer that never committed or aborted), no lease
without its connection, and the pool's own allocator consistent (its ``check()``). A
pin or a reservation goes back just after the request was answered (a load's pins
ride on the connection's next frame or leave within a few ms), so each check waits a
little before it fails.

* :func:`check_embedded` — a ``ContextCaching`` on the embedded pool: all of the above,
  the allocator checked in the process.
* :func:`check_server` — an ``ems-server`` (:class:`~ems.testing.ServerProcess`):
  every tenant's pins, reservations and leases from the daemon's report (a lease lives
  as long as its connection: a tenant without connections holds none), and with a
  cluster tier nothing left to write behind.
* :func:`check_stopped` — after the daemon stopped: its log has no line saying a
  pool's allocator failed its ``check()`` (the daemon checks every pool at stop).
"""

from __future__ import annotations

import time
from typing import Any, Union

from ems.protocol.report import DaemonReport, Wire

__all__ = ["check_embedded", "check_server", "check_stopped"]


def check_embedded(cc: Any, timeout_s: float = 5.0) -> Any:
    """Wait until ``cc``'s embedded pool holds no pins, reservations or leases, then
    check its allocator; the pool's statistics. A ``cc`` on a daemon is checked for
    pins and reservations only (use :func:`check_server` for the daemon)."""
    from ems.client.embedded import EmbeddedTransport
    transport = getattr(cc, "_transport", None)
    embedded = transport if isinstance(transport, EmbeddedTransport) else None
    deadline = time.monotonic() + timeout_s
    while True:
        stats = embedded.verify() if embedded is not None else cc.statistics()
        busy = {name: getattr(stats, name) for name in ("pinned", "reserved", "leases",
                                                        "leased_bytes")
                if getattr(stats, name, 0)}
        if not busy:
            assert stats.used_bytes <= stats.arena_bytes or not stats.arena_bytes, stats
            return stats
        assert time.monotonic() < deadline, f"the pool still holds {busy}: {stats}"
        time.sleep(0.01)


def _busy(report: Union[DaemonReport, Wire]) -> dict[str, dict[str, int]]:
    if not isinstance(report, DaemonReport):
        report = DaemonReport.from_wire(report)
    out: dict[str, dict[str, int]] = {}
    for name, t in report.tenants.items():
        held = {k: n for k, n in (("pinned", t.pinned), ("reserved", t.reserved)) if n}
        if not t.connections:
            held.update({k: n for k, n in (("leases", t.leases),
                                           ("leased_bytes", t.leased_bytes)) if n})
        elif t.leases > t.connections * 4:  # max_leases_per_connection
            held["leases"] = t.leases
        if held:
            out[name] = held
    # the cluster tier (all tenants together): values still to be written behind
    if report.cluster is not None and report.cluster.tier.write_behind_pending_bytes:
        out["(cluster tier)"] = {"write_behind_pending_bytes":
                                 report.cluster.tier.write_behind_pending_bytes}
    return out


def check_server(server: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    """Wait until no tenant of the running daemon ``server`` holds what a finished
    request took (see the module docstring); the last report."""
    deadline = time.monotonic() + timeout_s
    while True:
        report: dict[str, Any] = server.stats()
        busy = _busy(report)
        if not busy:
            return report
        assert time.monotonic() < deadline, f"ems-server still holds {busy}"
        time.sleep(0.02)


def check_stopped(server: Any) -> None:
    """After ``server`` stopped: no pool's allocator failed the daemon's check at stop."""
    from ems.server.daemon import ALLOCATOR_BROKEN
    broken = [line for line in server.log().splitlines() if ALLOCATOR_BROKEN in line]
    assert not broken, "\n".join(broken)
