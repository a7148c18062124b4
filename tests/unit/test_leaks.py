"""The teardown leak checks (``ems.testing.leaks``) find what a fixture must not leave
behind: a pin, a reservation, a lease, or an allocator whose extents do not add up."""

from __future__ import annotations

import dataclasses

import pytest

from ems.protocol.report import ClusterReport, ClusterTierRow, DaemonReport, TenantRow
from ems.testing.leaks import _busy, check_embedded


def _pool(cc):
    return cc._transport.pool


def test_a_clean_pool_passes(cc, option):
    check_embedded(cc, timeout_s=0.1)


@pytest.mark.parametrize("leak", ["pin", "reservation", "lease", "allocator"])
def test_each_leak_is_found(make_cc, leak):
    from ems import CcConfig
    cc = make_cc(cc_config=CcConfig(rank_id=0, device_id=0, model_id="leaks"))
    pool = _pool(cc)
    pool.commit([g.token for g in pool.reserve(["k"], [4096])])
    if leak == "pin":
        pins = pool.acquire(["k"], [4096])
        undo = lambda: pool.release([p.token for p in pins])
    elif leak == "reservation":
        tokens = [g.token for g in pool.reserve(["r"], [4096])]
        undo = lambda: pool.abort(tokens)
    elif leak == "lease":
        assert pool.lease(1 << 16, "conn-1") is not None
        undo = lambda: pool.drop_owner("conn-1")
    else:
        free = next(iter(pool.allocator._by_start))
        pool.allocator._by_start[free] += 64  # an extent overlapping the next one
        undo = lambda: pool.allocator._by_start.__setitem__(
            free, pool.allocator._by_start[free] - 64)
    try:
        with pytest.raises(AssertionError):
            check_embedded(cc, timeout_s=0.05)
    finally:
        undo()
    check_embedded(cc, timeout_s=0.1)


def test_a_daemon_report_with_leftovers_is_busy():
    row = TenantRow(*[0] * 9)

    def tenant(**figures: int) -> DaemonReport:
        return DaemonReport(tenants={"a": dataclasses.replace(row, **figures)})
    assert _busy(tenant()) == {}
    assert _busy(tenant(pinned=2)) == {"a": {"pinned": 2}}
    assert _busy(tenant(leases=1, leased_bytes=4096)) == {
        "a": {"leases": 1, "leased_bytes": 4096}}
    # a lease of a live connection is no leak
    assert _busy(tenant(leases=1, connections=1)) == {}
    cluster = ClusterReport(tier=ClusterTierRow(write_behind_pending_bytes=9))
    assert _busy(DaemonReport(cluster=cluster)) == {
        "(cluster tier)": {"write_behind_pending_bytes": 9}}
    # the wire form reads the same
    assert _busy(tenant(pinned=2).to_wire()) == {"a": {"pinned": 2}}


def test_a_daemon_checks_every_pool_at_stop_and_the_teardown_reads_it(tmp_path, caplog):
    """The daemon runs each pool's ``Allocator.check()`` when it stops and logs one
    ERROR line per broken pool; ``check_stopped`` fails a fixture on that line."""
    import logging

    from ems.server.config import ServerConfig
    from ems.server.daemon import ALLOCATOR_BROKEN, Daemon
    from ems.server.tenants import TenantRegistry, TenantSpec
    from ems.testing.leaks import check_stopped

    registry = TenantRegistry([TenantSpec(None, None, 1 << 20)], 60.0)
    daemon = Daemon(ServerConfig(socket_dir=str(tmp_path / "s"), capacity_bytes=1 << 20),
                    registry)
    try:
        with caplog.at_level(logging.ERROR, logger="ems.server.daemon"):
            daemon._check_allocators()
            assert not caplog.records  # a sound pool: nothing said
            pool = registry.anonymous.pool
            pool.allocator.used_bytes += 64  # break its books
            daemon._check_allocators()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and ALLOCATOR_BROKEN in lines[0]

        class Stopped:
            def log(self) -> str:
                return "\n".join(lines)
        with pytest.raises(AssertionError, match="allocator is inconsistent"):
            check_stopped(Stopped())
    finally:
        registry.close()
