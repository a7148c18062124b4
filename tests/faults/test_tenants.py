"""Tenants: challenge-response auth, one pool and one memfd per tenant, quotas."""

from __future__ import annotations

import ctypes
import os
import warnings

import pytest
from support.client_worker import Value, pattern
from support.itest_support import KEY_A, KEY_B, transport_load, transport_save

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.client.remote import RemoteTransport
from ems.keys import v0_storage_keys as storage

pytestmark = pytest.mark.integration

SIZE = 8192


@pytest.fixture
def tenant_server(make_server):
    return make_server(capacity="48M", tenants={"team-a": KEY_A, "team-b": KEY_B},
                       quotas={"team-a": "8M"})


def connect(server, access_id=None, access_key=None) -> RemoteTransport:
    return RemoteTransport.connect(server.socket_path, access_id, access_key, 3.0)


def save(t: RemoteTransport, keys, size=SIZE) -> int:
    """Save through the transport's verb, as ContextCaching does."""
    return transport_save(t, keys, size)


def test_tenants_cannot_see_or_map_each_other(tenant_server):
    a = connect(tenant_server, "team-a", KEY_A)
    b = connect(tenant_server, "team-b", KEY_B)
    anon = connect(tenant_server)
    try:
        keys = storage([f"secret{i}" for i in range(4)])
        assert save(a, keys) == 4
        assert a.exists(keys, None) == 4
        for other in (b, anon):  # same key names, other namespace
            assert other.exists(keys, None) == 0
            assert transport_load(other, keys, SIZE) == (0, [])
        # Different memory: B's and the anonymous mapping never hold A's bytes.
        seg_a = a._session.segment
        for other in (b, anon):
            seg = other._session.segment
            assert seg.id != seg_a.id
            data = ctypes.string_at(seg.address, seg.size)
            assert pattern(keys[0], SIZE)[:64] not in data
        assert pattern(keys[0], SIZE)[:64] in ctypes.string_at(seg_a.address, seg_a.size)
        # Quotas: team-a has its 8M, the other two share the remaining 40M.
        assert a.statistics().capacity_bytes == 8 << 20
        assert b.statistics().capacity_bytes == 20 << 20
        # A tenant's statistics show only itself; the admin report shows all.
        assert a.server_report(all_tenants=True)["tenants"].keys() == {"team-a"}
        report = tenant_server.stats()["tenants"]
        assert set(report) == {"team-a", "team-b", "(anonymous)"}
        assert report["team-a"]["objects"] == 4 and report["team-b"]["objects"] == 0
        assert report["team-a"]["connections"] == 1
    finally:
        for t in (a, b, anon):
            t.close()


@pytest.mark.parametrize("access_id, access_key", [
    ("team-a", KEY_B),          # wrong key
    ("team-c", KEY_A),          # unknown id
])
def test_wrong_credentials_fail_init_with_auth_failed(tenant_server, client_env, access_id,
                                                      access_key):
    client_env(tenant_server)
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(access_id=access_id, access_key=access_key,
                           cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert info.value.status_code() is EmsErrorCode.EMS_AUTH_FAILED
    assert KEY_A not in str(info.value) and KEY_B not in str(info.value)
    assert Ems.get_cc() is None
    assert "refused" in tenant_server.log()


def test_context_caching_with_credentials_end_to_end(tenant_server, client_env, workers):
    client_env(tenant_server)
    Ems.init(EmsConfig(access_id="team-a", access_key=KEY_A,
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    cc = Ems.get_cc()
    keys = ["p0", "p1"]
    vals = [Value(SIZE, pattern(k, SIZE)) for k in keys]
    assert cc.save(CcKvOption(), keys, [v.wrappers() for v in vals]).success == 2
    # another process of team-a hits; team-b and anonymous processes miss
    creds_a = {"access_id": "team-a", "access_key": KEY_A}
    assert workers.run(tenant_server, "load", keys=keys, size=SIZE, **creds_a) == \
        {"success": 2, "wrong": 0}
    creds_b = {"access_id": "team-b", "access_key": KEY_B}
    assert workers.run(tenant_server, "load", keys=keys, size=SIZE, **creds_b)["success"] == 0
    assert workers.run(tenant_server, "load", keys=keys, size=SIZE)["success"] == 0
    Ems.finalize()


def test_anonymous_access_can_be_disabled(make_server, client_env):
    server = make_server(capacity="16M", tenants={"team-a": KEY_A}, anonymous=False)
    client_env(server)
    with pytest.raises(EmsException) as info:
        Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert info.value.status_code() is EmsErrorCode.EMS_AUTH_FAILED
    assert "anonymous access is disabled" in info.value.message()
    Ems.init(EmsConfig(access_id="team-a", access_key=KEY_A,
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    assert Ems.check_health()
    assert set(server.stats()["tenants"]) == {"team-a"}
    Ems.finalize()


def test_reconnect_authenticates_again(make_server, client_env):
    server = make_server(capacity="16M", tenants={"team-a": KEY_A}, anonymous=False)
    client_env(server)
    Ems.init(EmsConfig(access_id="team-a", access_key=KEY_A,
                       cc_config=CcConfig(rank_id=0, device_id=0, model_id="m")))
    server.kill()
    server.start()
    assert Ems.check_health()
    cc = Ems.get_cc()
    v = Value(SIZE, pattern("r", SIZE))
    assert cc.save(CcKvOption(), ["r"], [v.wrappers()]).success == 1
    assert server.stats()["tenants"]["team-a"]["objects"] == 1
    Ems.finalize()


def test_a_forked_child_gets_its_own_connection(server):
    parent = connect(server)
    try:
        keys = storage(["forked"])
        assert save(parent, keys) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:  # child: only os._exit leaves it
            code = 1
            try:
                ok = parent.exists(keys, [SIZE]) == 1 and parent._session.gen == 2
                code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert parent.exists(keys, [SIZE]) == 1  # the parent's connection is untouched
        assert parent._session.gen == 1
    finally:
        parent.close()
