"""The daemon's registry with several keys per tenant (control-plane tenants)."""

from __future__ import annotations

import os

from ems.protocol import auth_mac
from ems.server.tenants import TenantRegistry, TenantSpec

K1, K2, K3 = "1" * 40, "2" * 40, "3" * 40


def test_each_key_of_a_tenant_opens_it_and_names_itself():
    reg = TenantRegistry([TenantSpec("team-a", K1, 1 << 20)], 60.0)
    try:
        tenant = reg.get("team-a")
        assert tenant.keys == {"file": K1} and tenant.source == "config"
        tenant.keys = {"k-1": K1, "k-2": K2}
        nonce = os.urandom(32)
        assert reg.authenticate("team-a", nonce, auth_mac(K1, nonce, "team-a")) == (tenant, "k-1")
        assert reg.authenticate("team-a", nonce, auth_mac(K2, nonce, "team-a")) == (tenant, "k-2")
        assert reg.authenticate("team-a", nonce, auth_mac(K3, nonce, "team-a")) is None
        assert reg.authenticate("team-b", nonce, auth_mac(K1, nonce, "team-b")) is None
        # a MAC over another nonce or for another id does not open it
        assert reg.authenticate("team-a", nonce, auth_mac(K1, os.urandom(32), "team-a")) is None
        assert reg.verify("team-a", nonce, auth_mac(K2, nonce, "team-a")) is tenant
        tenant.keys = {}  # every key revoked: nothing opens it
        assert reg.authenticate("team-a", nonce, auth_mac(K1, nonce, "team-a")) is None
    finally:
        reg.close()


def test_tenants_are_added_and_removed_at_run_time():
    from ems.server.tenants import Tenant
    reg = TenantRegistry([], 60.0)
    try:
        t = Tenant(TenantSpec("new", None, 1 << 20), 60.0)
        t.keys = {"k-9": K1}
        reg.add(t)
        nonce = os.urandom(32)
        assert reg.authenticate("new", nonce, auth_mac(K1, nonce, "new")) == (t, "k-9")
        assert reg.named() == ["new"]
        assert reg.remove("new") is t and reg.remove("new") is None
        assert reg.authenticate("new", nonce, auth_mac(K1, nonce, "new")) is None
        t.close()
    finally:
        reg.close()
