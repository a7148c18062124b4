"""The typed report's wire form: generated from the rows' fields, round-trips, and
reads an older daemon's dict (fewer keys) and a newer one's (more keys)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ems.errors import EmsErrorCode, EmsException
from ems.protocol.report import DaemonReport, ServerRow, TenantRow

_counts = st.integers(min_value=0, max_value=2**62)
_tenant = st.builds(TenantRow, **{k: _counts for k in (
    "capacity_bytes", "used_bytes", "objects", "reserved", "pinned", "hits", "misses",
    "evictions", "expired_reservations")}, connections=_counts,
                    source=st.sampled_from(["config", "control", "file"]),
                    tiers=st.dictionaries(st.sampled_from(["disk", "cluster"]),
                                          st.fixed_dictionaries({"hits": _counts})))
_server = st.builds(ServerRow, pid=_counts, uptime_s=st.floats(0, 1e9),
                    refused=st.dictionaries(st.text(min_size=1, max_size=8), _counts))
_report = st.builds(DaemonReport, server=_server,
                    tenants=st.dictionaries(st.text(min_size=1, max_size=8), _tenant),
                    parts=st.dictionaries(st.sampled_from(["disk", "cluster"]),
                                          st.fixed_dictionaries({"lookups": _counts})))


@given(_report)
def test_round_trip(report: DaemonReport) -> None:
    assert DaemonReport.from_wire(report.to_wire()) == report


@given(_tenant)
def test_hit_rate_on_the_wire_is_the_one_definition(row: TenantRow) -> None:
    wire = row.to_wire()
    lookups = row.hits + row.misses
    assert wire["hit_rate"] == (row.hits / lookups if lookups else 0.0)
    assert ("tiers" in wire) == bool(row.tiers)


def test_old_and_new_wire_dicts_decode() -> None:
    old = {"server": {"pid": 7, "version": "0.1", "protocol": 4, "uptime_s": 1.5},
           "tenants": {"a": {"capacity_bytes": 10, "used_bytes": 1, "objects": 1,
                             "reserved": 0, "pinned": 0, "hits": 3, "misses": 1,
                             "evictions": 0, "expired_reservations": 0,
                             "hit_rate": 0.75, "later_counter": 9}},
           "disk": {"lookups": 4}}
    r = DaemonReport.from_wire(old)
    assert r.server.pid == 7 and r.server.connections == 0
    assert r.tenants["a"].hits == 3 and r.tenants["a"].hit_rate == 0.75
    assert r.parts == {"disk": {"lookups": 4}}
    wire = r.to_wire()
    assert set(old["tenants"]["a"]) - {"later_counter"} <= set(wire["tenants"]["a"])


def test_a_field_of_the_wrong_type_is_named() -> None:
    row = dataclasses.asdict(TenantRow(*[0] * 9))
    row["hits"] = "3"
    with pytest.raises(EmsException) as e:
        TenantRow.from_wire(row)
    assert e.value.status_code() == EmsErrorCode.EMS_PROTOCOL_ERROR
    assert "TenantRow.hits" in str(e.value)
