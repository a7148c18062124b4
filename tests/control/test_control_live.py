"""Live on every daemon: a control plane and two daemons started here; tenants, keys
and quotas change over REST and the daemons apply them without a restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from support.control_support import wait_for
from support.itest_support import transport_load, transport_save

from ems.client.remote import RemoteTransport
from ems.errors import EmsErrorCode, EmsException
from ems.keys import v0_storage_keys as storage

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdk_client.py")
SIZE = 64 << 10
IDENT = "org/Team-A:v2@svc"  # an id of a real deployment (the SDK's rule)


def sdk(server, access_id: str, access_key: str, keys: list[str]) -> dict:
    """Run a tenant's inference process (the SDK) against ``server``."""
    env = dict(os.environ, **server.client_env(), EMS_CONNECT_TIMEOUT_MS="3000")
    proc = subprocess.Popen([sys.executable, CLIENT, json.dumps(
        {"access_id": access_id, "access_key": access_key, "keys": keys})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def connect(server, access_id: str, key: str) -> RemoteTransport:
    return RemoteTransport.connect(server.socket_path, access_id, key, 3.0)


def accepts(server, access_id: str, key: str) -> bool:
    try:
        connect(server, access_id, key).close()
        return True
    except EmsException as exc:
        assert exc.status_code() is EmsErrorCode.EMS_AUTH_FAILED, exc
        return False


def new_tenant(control, servers, access_id: str, quota: str, what: str = "the tenant"
               ) -> str:
    """Create ``access_id`` over REST with a key; its access key, once every one of
    ``servers`` accepts it."""
    _, t = control.call("POST", "/v1/tenants", {"access_id": access_id, "quota": quota,
                                                "issue_key": True})
    key = t["key"]["access_key"]
    for server in servers:
        wait_for(lambda s=server: accepts(s, access_id, key), 5.0, what)
    return key


def save(t: RemoteTransport, keys: list, size: int = SIZE) -> int:
    """Through the transport's verb, as ContextCaching saves."""
    return transport_save(t, keys, size)


def tenant_row(server, name: str):
    return server.stats()["tenants"].get(name)


@pytest.fixture
def two(control, daemons):
    """The control plane and two daemons (default registry poll: 1 s)."""
    return control, [daemons.start(control, f"host-{i}", poll_s="1.0") for i in (1, 2)]


def test_a_tenant_created_over_rest_connects_through_the_sdk_on_both(two):
    control, hosts = two
    t0 = time.monotonic()
    status, t = control.call("POST", "/v1/tenants", {"access_id": IDENT, "quota": "16M",
                                                     "issue_key": True})
    assert status == 201
    key = t["key"]["access_key"]
    for server in hosts:
        wait_for(lambda s=server: accepts(s, IDENT, key), 5.0, "the new tenant")
    elapsed = time.monotonic() - t0
    print(f"\nnew tenant accepted by both daemons {elapsed:.2f} s after POST")
    assert elapsed < 5.0
    for server in hosts:
        assert sdk(server, IDENT, key, ["p0", "p1", "p2"]) == {
            "saved": 3, "loaded": 3, "wrong": 0}
        row = tenant_row(server, IDENT)
        assert row["capacity_bytes"] == 16 << 20 and row["objects"] == 3
        assert row["source"] == "control"
    refused = sdk(hosts[0], IDENT, "Z" * 64, ["p0"])  # a wrong key
    assert refused["error"] == "EMS_AUTH_FAILED"

    def pool_rows():  # the pool state per host and tenant, as the daemons reported it
        rows = [r for r in control.call("GET", "/v1/pool")[1] if r["tenant"] == IDENT]
        return rows if len(rows) == 2 and all(r["objects"] == 3 for r in rows) else None
    rows = wait_for(pool_rows, 5.0, "both daemons' reports")
    assert sorted(r["host"] for r in rows) == ["host-1", "host-2"]
    for r in rows:
        assert r["capacity_bytes"] == 16 << 20 and r["used_bytes"] > 0
        assert r["tiers"]["local"]["hits"] == 3 and r["tiers"]["local"]["hit_rate"] == 1.0
    assert control.call("DELETE", "/v1/hosts/host-2")[0] == 200  # a host gone for good
    assert control.call("GET", "/v1/hosts/host-1")[0] == 200


def test_a_revoked_key_is_refused_on_both_within_5_s_and_its_sessions_close(two):
    control, hosts = two
    _, t = control.call("POST", "/v1/tenants", {"access_id": "team-a", "quota": "16M",
                                                "issue_key": True})
    k1 = t["key"]
    _, k2 = control.call("POST", "/v1/tenants/team-a/keys")
    for server in hosts:
        wait_for(lambda s=server: accepts(s, "team-a", k2["access_key"]), 5.0, "the keys")
    live1 = [connect(s, "team-a", k1["access_key"]) for s in hosts]
    live2 = [connect(s, "team-a", k2["access_key"]) for s in hosts]
    try:
        for t1 in live1:
            assert save(t1, storage(["before"])) == 1
        t0 = time.monotonic()
        assert control.call("DELETE", f"/v1/tenants/team-a/keys/{k1['key_id']}")[0] == 200
        times = []
        for server in hosts:
            wait_for(lambda s=server: not accepts(s, "team-a", k1["access_key"]), 5.0,
                     "the revocation")
            times.append(time.monotonic() - t0)
        print(f"\nrevoked key refused {times[0]:.2f} s / {times[1]:.2f} s after DELETE")
        assert max(times) < 5.0
        # its live sessions were closed by the daemons; the other key's sessions stay
        for server in hosts:
            wait_for(lambda s=server: tenant_row(s, "team-a")["connections"] == 1, 2.0,
                     "the revoked key's session to close")
        for t1 in live1:
            with pytest.raises(EmsException) as info:
                t1.exists(storage(["before"]), None)
            assert info.value.status_code() is EmsErrorCode.EMS_AUTH_FAILED
        for t2 in live2:
            assert t2.exists(storage(["before"]), None) == 1  # the cached data stays
        assert sdk(hosts[1], "team-a", k1["access_key"], ["x"])["error"] == "EMS_AUTH_FAILED"
        assert sdk(hosts[1], "team-a", k2["access_key"], ["x"])["loaded"] == 1
    finally:
        for t in live1 + live2:
            t.close()


def test_a_deleted_tenant_is_closed_and_refused_on_both(two):
    control, hosts = two
    key = new_tenant(control, hosts, "team-d", "8M")
    live = connect(hosts[0], "team-d", key)
    try:
        assert control.call("DELETE", "/v1/tenants/team-d")[0] == 200
        for server in hosts:
            wait_for(lambda s=server: tenant_row(s, "team-d") is None, 5.0, "the deletion")
            assert not accepts(server, "team-d", key)
        with pytest.raises(EmsException):
            live.exists(storage(["k"]), None)
    finally:
        live.close()


def test_a_quota_change_applies_live_without_dropping_cached_data(two):
    control, hosts = two
    key = new_tenant(control, hosts, "team-q", "16M")
    sessions = [connect(s, "team-q", key) for s in hosts]
    try:
        keys = storage([f"q{i}" for i in range(64)])  # 4 MiB
        for s in sessions:
            assert save(s, keys) == 64
        rev = control.call("GET", "/v1/hosts")[1]["revision"]
        control.call("PUT", "/v1/tenants/team-q/quota", {"quota": "8M"})  # still fits
        for server in hosts:
            wait_for(lambda s=server: tenant_row(s, "team-q")["capacity_bytes"] == 8 << 20,
                     5.0, "the new quota")
            row = tenant_row(server, "team-q")
            assert row["objects"] == 64 and row["evictions"] == 0  # nothing dropped
        control.call("PUT", "/v1/tenants/team-q/quota", {"quota": "2M"})  # below the data
        for server, s in zip(hosts, sessions):
            wait_for(lambda sv=server: tenant_row(sv, "team-q")["capacity_bytes"] == 2 << 20,
                     5.0, "the lower quota")
            row = tenant_row(server, "team-q")
            assert row["used_bytes"] <= 2 << 20
            assert 0 < row["objects"] < 64 and row["evictions"] == 64 - row["objects"]
            # the most recent keys stayed, readable, on the same connection
            assert s.exists(keys[-8:], None) == 8
            assert transport_load(s, keys[-8:], SIZE)[0] == 8
        control.call("PUT", "/v1/tenants/team-q/quota", {"quota": "64M"})  # above the segment
        for server in hosts:
            wait_for(lambda s=server: tenant_row(s, "team-q")["quota_bytes"] == 64 << 20,
                     5.0, "the raise")
            row = tenant_row(server, "team-q")
            assert row["capacity_bytes"] == row["arena_bytes"] == 16 << 20
            assert "above its segment" in server.log()
        assert control.call("GET", "/v1/hosts")[1]["revision"] == rev + 3
    finally:
        for s in sessions:
            s.close()


def test_daemons_keep_serving_while_the_control_plane_is_down(two):
    control, hosts = two
    _, t = control.call("POST", "/v1/tenants", {"access_id": "team-a", "quota": "16M",
                                                "issue_key": True})
    key, kid = t["key"]["access_key"], t["key"]["key_id"]
    for server in hosts:
        wait_for(lambda s=server: accepts(s, "team-a", key), 5.0, "the tenant")
    live = [connect(s, "team-a", key) for s in hosts]
    try:
        control.stop()
        for server in hosts:
            wait_for(lambda s=server: "serving with the registry of revision" in s.log(), 5.0,
                     "the daemon to notice")
        for server, s in zip(hosts, live):
            assert save(s, storage(["down"])) == 1  # live sessions go on
            assert accepts(server, "team-a", key)  # and new ones open (last registry)
            assert sdk(server, "team-a", key, ["d0", "d1"])["loaded"] == 2
        control.start()  # back on its port: the daemons pick up changes again
        control.call("DELETE", f"/v1/tenants/team-a/keys/{kid}")
        for server in hosts:
            wait_for(lambda s=server: not accepts(s, "team-a", key), 5.0,
                     "the revocation after the outage")
            assert "reachable" in server.log()
    finally:
        for s in live:
            s.close()


def test_a_tenant_that_does_not_fit_is_refused_on_that_daemon_only(control, daemons):
    small = daemons.start(control, "small", capacity="32M")
    big = daemons.start(control, "big", capacity="128M")
    _, t = control.call("POST", "/v1/tenants", {"access_id": "team-big", "quota": "64M",
                                                "issue_key": True})
    key = t["key"]["access_key"]
    wait_for(lambda: accepts(big, "team-big", key), 5.0, "the tenant on the big daemon")
    wait_for(lambda: "refused on this daemon" in small.log(), 5.0, "the refusal")
    assert not accepts(small, "team-big", key)
    report = wait_for(lambda: {h["host"]: h["report"] for h in
                               control.call("GET", "/v1/hosts")[1]["hosts"]
                               if "small" in h["host"]}.get("small"), 5.0, "a report")
    assert "team-big" in report["control"]["refused"]


def test_a_daemon_restarted_while_the_control_plane_is_down_serves_from_its_cache(
        control, daemons, tmp_path):
    cache = str(tmp_path / "registry.cache")
    server = daemons.start(control, "cached", extra=("--control-cache", cache))
    key = new_tenant(control, [server], "team-c", "8M")
    wait_for(lambda: os.path.exists(cache), 2.0, "the cache")
    assert os.stat(cache).st_mode & 0o777 == 0o600
    with open(cache, "rb") as f:
        assert key.encode() not in f.read()  # sealed under the daemon token
    control.stop()
    server.restart()
    wait_for(lambda: "from " + cache in server.log(), 5.0, "the cache to be used")
    # The log line comes as the plan is handed to the loop, which applies it next.
    wait_for(lambda: accepts(server, "team-c", key), 5.0, "the cached tenant")
    assert not accepts(server, "team-c", "Q" * 64)
    os.chmod(cache, 0o644)  # a cache others can read is not used
    server.restart()
    wait_for(lambda: "mode 0644, not 0600" in server.log(), 5.0, "the refusal")
    assert not accepts(server, "team-c", key)


def segment_mapped(server, access_id: str) -> bool:
    """Whether the daemon maps ``access_id``'s shared memory (its memfd, by name)."""
    with open(f"/proc/{server.pid}/maps") as f:
        return any(f"/memfd:ems-pool-{access_id} " in line for line in f)


def test_a_deleted_tenant_s_memory_leaves_the_disk_tier(control, daemons, tmp_path):
    """The disk tier maps a tenant's memory to write it out; a deleted tenant's memory is
    unmapped (so given back), not kept until the daemon stops, and its write-outs
    still queued go with it."""
    server = daemons.start(control, "host-m", extra=(
        "--disk", str(tmp_path / "disk"), "--disk-capacity", "64M"))
    key = new_tenant(control, [server], "team-m", "8M")
    live = connect(server, "team-m", key)
    try:
        assert save(live, storage([f"m{i}" for i in range(32)])) == 32
        wait_for(lambda: server.stats()["disk"]["writes"] >= 32, 10.0, "the write-out")
        assert segment_mapped(server, "team-m")
    finally:
        live.close()
    assert control.call("DELETE", "/v1/tenants/team-m")[0] == 200
    wait_for(lambda: tenant_row(server, "team-m") is None, 5.0, "the deletion")
    wait_for(lambda: not segment_mapped(server, "team-m"), 5.0, "the memory unmapped")
    # A tenant of the same name made again gets fresh memory and works.
    key = new_tenant(control, [server], "team-m", "8M", "the tenant again")
    again = connect(server, "team-m", key)
    try:
        assert save(again, storage(["n0"])) == 1
        assert transport_load(again, storage(["n0"]), SIZE)[0] == 1
    finally:
        again.close()
