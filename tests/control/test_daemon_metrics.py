"""The daemon's Prometheus exporter, scraped over HTTP and parsed with
prometheus_client's own parser."""

from __future__ import annotations

import pytest
from support.control_support import connect_when_registered, free_port, scrape, value
from support.itest_support import transport_load, transport_save

from ems.client.remote import RemoteTransport
from ems.errors import EmsException
from ems.keys import v0_storage_keys as storage
from ems.testing import run_server

pytestmark = pytest.mark.integration

SIZE = 16 << 10


def test_metrics_of_a_controlled_daemon(control, daemons):
    port = free_port()
    server = daemons.start(control, "host-m", metrics_port=port)
    _, t = control.call("POST", "/v1/tenants", {"access_id": "team-m", "quota": "16M",
                                                "issue_key": True})
    key = t["key"]["access_key"]

    tr = connect_when_registered(server, "team-m", key)
    try:
        keys = storage([f"m{i}" for i in range(4)])
        assert transport_save(tr, keys, SIZE) == 4
        assert transport_load(tr, keys, SIZE)[0] == 4
        assert transport_load(tr, storage(["absent"]), SIZE)[0] == 0
        assert transport_load(tr, keys[:1], SIZE + 64)[0] == 0  # another size: a miss
        fams = scrape(port)
    finally:
        tr.close()
    tenant = {"tenant": "team-m"}
    assert value(fams, "ems_pool_hits", tier="local", **tenant) == 4
    assert value(fams, "ems_pool_misses", tier="local", reason="absent", **tenant) == 1
    assert value(fams, "ems_pool_misses", tier="local", reason="size_mismatch", **tenant) == 1
    assert value(fams, "ems_pool_misses", tier="local", reason="pending", **tenant) == 0
    assert value(fams, "ems_pool_hit_bytes", tier="local", **tenant) == 4 * SIZE
    assert value(fams, "ems_pool_stored_bytes", tier="local", **tenant) == 4 * SIZE
    assert value(fams, "ems_pool_capacity_bytes", **tenant) == 16 << 20
    assert value(fams, "ems_pool_objects", **tenant) == 4
    assert value(fams, "ems_pool_refusals", reason="full", **tenant) == 0
    assert value(fams, "ems_tenant_connections", **tenant) == 1
    assert value(fams, "ems_connections") >= 1
    assert value(fams, "ems_control_reachable") == 1
    revision = control.call("GET", "/v1/hosts")[1]["revision"]
    assert value(fams, "ems_control_registry_revision") == revision
    # latency per verb: a histogram whose +Inf bucket is its count
    acquire = {"verb": "acquire"}
    count = value(fams, "ems_request_duration_seconds", "ems_request_duration_seconds_count",
                  **acquire)
    assert count == 3
    assert value(fams, "ems_request_duration_seconds", "ems_request_duration_seconds_bucket",
                 le="+Inf", **acquire) == count
    assert 0 < value(fams, "ems_request_duration_seconds", "ems_request_duration_seconds_sum",
                     **acquire) < 1.0
    assert value(fams, "ems_request_duration_seconds", "ems_request_duration_seconds_count",
                 verb="reserve") == 1
    # conventions: one prefix, counters end in _total, units in the names
    for name, family in fams.items():
        assert name.startswith("ems_"), name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), name
    assert fams["ems_request_duration_seconds"].type == "histogram"
    assert fams["ems_pool_used_bytes"].type == "gauge"


def test_metrics_of_a_standalone_daemon_and_off_by_default(tmp_path):
    port = free_port()
    with run_server(str(tmp_path), capacity="16M",
                    extra_args=["--metrics-addr", f"127.0.0.1:{port}",
                                "--limit", "max_connections_per_tenant=1"]) as server:
        first = RemoteTransport.connect(server.socket_path, None, None, 3.0)
        try:
            with pytest.raises(EmsException):  # over the limit: refused, and counted
                RemoteTransport.connect(server.socket_path, None, None, 3.0)
            assert transport_save(first, storage(["big1", "big2"]), 1 << 20) == 2
            fams = scrape(port)
        finally:
            first.close()
        assert value(fams, "ems_limit_refusals", limit="max_connections_per_tenant") == 1
        assert value(fams, "ems_pool_capacity_bytes", tenant="(anonymous)") == 16 << 20
        # where the bytes are: used = live + reserved + leased; free is the rest
        live = value(fams, "ems_pool_live_bytes", tenant="(anonymous)")
        assert live == 2 << 20
        assert value(fams, "ems_pool_reserved_bytes", tenant="(anonymous)") == 0
        assert value(fams, "ems_pool_used_bytes", tenant="(anonymous)") == live + value(
            fams, "ems_pool_leased_bytes", tenant="(anonymous)")
        assert value(fams, "ems_pool_free_bytes", tenant="(anonymous)") == (16 << 20) - value(
            fams, "ems_pool_used_bytes", tenant="(anonymous)")
        for cause in ("capacity", "fragmentation"):
            assert value(fams, "ems_pool_evictions_by_cause", tenant="(anonymous)",
                         cause=cause) == 0
        assert value(fams, "ems_pool_evicted_bytes", tenant="(anonymous)") == 0
        assert "ems_control_reachable" not in fams
        assert f"metrics on http://127.0.0.1:{port}" in server.log()
    plain = tmp_path / "plain"
    plain.mkdir()
    with run_server(str(plain), capacity="16M") as server:
        assert "Prometheus" not in server.log()


def test_a_metrics_address_in_use_or_malformed_stops_the_daemon(tmp_path):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with run_server(str(tmp_path), capacity="16M", start=False,
                        extra_args=["--metrics-addr", f"127.0.0.1:{port}"]) as server:
            with pytest.raises(RuntimeError, match="exited with 2"):
                server.start()
            assert "cannot listen" in server.log()
    bad = tmp_path / "bad"
    bad.mkdir()
    with run_server(str(bad), capacity="16M", start=False,
                    extra_args=["--metrics-addr", "nonsense"]) as server:
        with pytest.raises(RuntimeError, match="exited with 2"):
            server.start()
        assert "metrics_addr must be HOST:PORT" in server.log()
