"""The typed report's wire form: generated from the rows' fields, round-trips, and
reads an older daemon's dict (fewer keys) and a newer one's (more keys)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ems.errors import EmsErrorCode, EmsException
from ems.protocol.report import (
    ClusterNodeRow,
    ClusterReport,
    ClusterTierRow,
    DaemonReport,
    DiskReport,
    DiskTenantRow,
    EventsReport,
    ServerRow,
    TenantRow,
    TenantTiers,
    TierRow,
    TierTotals,
)

_counts = st.integers(min_value=0, max_value=2**62)
_tenant = st.builds(TenantRow, **{k: _counts for k in (
    "capacity_bytes", "used_bytes", "objects", "reserved", "pinned", "hits", "misses",
    "evictions", "expired_reservations")}, connections=_counts,
                    source=st.sampled_from(["config", "control", "file"]),
                    tiers=st.builds(TenantTiers,
                                    disk=st.none() | st.builds(DiskTenantRow, hits=_counts,
                                                               quota_bytes=st.none() | _counts),
                                    cluster=st.none() | st.builds(TierRow, hits=_counts)))
_server = st.builds(ServerRow, pid=_counts, uptime_s=st.floats(0, 1e9),
                    refused=st.dictionaries(st.text(min_size=1, max_size=8), _counts))
_report = st.builds(DaemonReport, server=_server,
                    tenants=st.dictionaries(st.text(min_size=1, max_size=8), _tenant),
                    disk=st.none() | st.builds(
                        DiskReport, tier=st.builds(TierTotals, lookups=_counts),
                        read_latency_p50_s=st.none() | st.floats(0, 10),
                        admissions_refused=st.dictionaries(st.sampled_from(["quota"]), _counts)),
                    cluster=st.none() | st.builds(
                        ClusterReport, seeds=st.lists(st.text(max_size=8), max_size=2),
                        tier=st.builds(ClusterTierRow, hits=_counts,
                                       latency_p50_ms=st.floats(0, 9)),
                        nodes=st.lists(st.builds(ClusterNodeRow, node=st.text(max_size=8),
                                                 slots=_counts), max_size=2)),
                    kv_events=st.none() | st.builds(EventsReport, next_seq=_counts),
                    others=st.dictionaries(st.sampled_from(["a_newer_part"]),
                                           st.fixed_dictionaries({"lookups": _counts})))


@given(_report)
def test_round_trip(report: DaemonReport) -> None:
    assert DaemonReport.from_wire(report.to_wire()) == report


@given(_tenant)
def test_hit_rate_on_the_wire_is_the_one_definition(row: TenantRow) -> None:
    wire = row.to_wire()
    lookups = row.hits + row.misses
    assert wire["hit_rate"] == (row.hits / lookups if lookups else 0.0)
    assert ("tiers" in wire) == (row.tiers != TenantTiers())
    for _, tier in row.tiers.beyond_shared_memory():
        assert tier.to_wire()["hit_rate"] == tier.hit_rate == (
            tier.hits / (tier.hits + tier.misses) if tier.hits + tier.misses else 0.0)


def test_old_and_new_wire_dicts_decode() -> None:
    old = {"server": {"pid": 7, "version": "0.1", "protocol": 4, "uptime_s": 1.5},
           "tenants": {"a": {"capacity_bytes": 10, "used_bytes": 1, "objects": 1,
                             "reserved": 0, "pinned": 0, "hits": 3, "misses": 1,
                             "evictions": 0, "expired_reservations": 0,
                             "hit_rate": 0.75, "later_counter": 9}},
           "disk": {"state": "ok", "tier": {"lookups": 4}}, "a_newer_part": {"lookups": 5}}
    r = DaemonReport.from_wire(old)
    assert r.server.pid == 7 and r.server.connections == 0
    assert r.tenants["a"].hits == 3 and r.tenants["a"].hit_rate == 0.75
    assert r.disk == DiskReport(state="ok", tier=TierTotals(lookups=4))
    assert r.cluster is None and r.kv_events is None
    assert r.others == {"a_newer_part": {"lookups": 5}}
    wire = r.to_wire()
    assert set(old["tenants"]["a"]) - {"later_counter"} <= set(wire["tenants"]["a"])
    assert wire["a_newer_part"] == {"lookups": 5} and "cluster" not in wire


def test_a_field_of_the_wrong_type_is_named() -> None:
    row = dataclasses.asdict(TenantRow(*[0] * 9))
    row["hits"] = "3"
    with pytest.raises(EmsException) as e:
        TenantRow.from_wire(row)
    assert e.value.status_code() == EmsErrorCode.EMS_PROTOCOL_ERROR
    assert "TenantRow.hits" in str(e.value)


def test_the_disk_report_repeats_the_disk_stores_figures() -> None:
    """``ems.disk`` imports only ``errors``: DiskReport repeats its DiskStatistics (but
    the per-tenant rows, which are ``TenantRow.tiers.disk``)."""
    from ems.disk.stats import DiskStatistics
    store = {f.name for f in dataclasses.fields(DiskStatistics)} - {"tenants"}
    assert store <= {f.name for f in dataclasses.fields(DiskReport)}


def test_the_kv_event_publishers_statistics_are_its_report_row() -> None:
    from ems.server.kv_events import KvEventStatistics
    assert KvEventStatistics is EventsReport


def test_the_pool_cores_hit_rate_agrees_with_the_one_definition() -> None:
    """``ems.pool`` imports nothing of ours, so its PoolStatistics keeps its own."""
    from ems.pool.core import PoolStatistics as CoreStatistics
    from ems.protocol.report import hit_rate
    for hits, misses in ((0, 0), (3, 1), (0, 5), (7, 0)):
        core = CoreStatistics(0, 0, 0, 0, 0, hits, misses, 0, 0)
        assert core.hit_rate == hit_rate(hits, misses)
