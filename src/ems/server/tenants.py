"""Tenants: one pool and one memfd per namespace, and the challenge-response check.

Each namespace (a tenant from the tenants file, or the anonymous one) owns a
:class:`~ems.pool.core.Pool` sized by its quota and a memfd of the same size that
holds its bytes. The memfd has no name in any filesystem (``memfd_create``), so it
cannot be opened by guessing; the daemon hands it over (SCM_RIGHTS) only to
connections that authenticated as that tenant. It is sealed against shrinking and
growing, so no client can truncate it under the others (which would make their
copies fault). The daemon itself never maps it: the pool core only does bookkeeping.
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import secrets
import time
from typing import Callable, Iterable, Optional

from ems.pool.core import Pool
from ems.protocol import auth_mac
from ems.server.config import TenantSpec

__all__ = ["Tenant", "TenantRegistry"]

logger = logging.getLogger(__name__)

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _memfd_name(tenant: str) -> str:
    """A memfd's name (shown in /proc/PID/maps; at most 249 bytes): the tenant's name in
    safe characters, cut short (ids may be 512 characters of any printable kind)."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.@") else "_"
                   for c in tenant[:64])
    return f"ems-pool-{safe}"


class Tenant:
    """A namespace's pool, memory and counters (owned by the daemon's loop)."""

    def __init__(self, spec: TenantSpec, reservation_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.name = spec.name
        self.pool = Pool(spec.quota_bytes, reservation_ttl_s=reservation_ttl_s, clock=clock)
        self.segment_size = self.pool.capacity_bytes
        # A random id: segments of a restarted daemon never look like the old ones.
        self.segment_id = secrets.randbits(48)
        self.fd = os.memfd_create(_memfd_name(self.name),
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.segment_size)
            # Take the memory now, as Mooncake's global segment does: a pool that
            # cannot have its capacity fails at start, not mid-save, and clients map
            # it populated (no page fault per 4 KiB page on their first pass).
            os.posix_fallocate(self.fd, 0, self.segment_size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(self.fd)
            raise
        self.connections = 0
        #: key_id -> access_key: every key that opens this namespace (the tenants file
        #: gives one; the control plane any number, each revocable on its own)
        self.keys: dict[str, str] = {"file": spec.access_key} if spec.access_key else {}
        #: "config" (tenants file, anonymous) or "control" (ems-control, may change)
        self.source = "config"
        #: the quota in force; may differ from ``pool.capacity_bytes`` only when it is
        #: above the segment (sealed at its size), see ems.server.control_sync
        self.quota_bytes = spec.quota_bytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class TenantRegistry:
    """All namespaces of the daemon, and who may enter which."""

    def __init__(self, specs: Iterable[TenantSpec], reservation_ttl_s: float) -> None:
        self._by_id: dict[Optional[str], Tenant] = {}
        try:
            for spec in specs:
                self._by_id[spec.access_id] = Tenant(spec, reservation_ttl_s)
        except BaseException:
            self.close()
            raise

    def __iter__(self):
        return iter(self._by_id.values())

    @property
    def anonymous(self) -> Optional[Tenant]:
        return self._by_id.get(None)

    def named(self) -> list[str]:
        return sorted(k for k in self._by_id if k is not None)

    def verify(self, access_id: str, nonce: bytes, mac: bytes) -> Optional[Tenant]:
        """The tenant whose key produced ``mac`` over ``nonce``; None otherwise."""
        found = self.authenticate(access_id, nonce, mac)
        return None if found is None else found[0]

    def authenticate(self, access_id: str, nonce: bytes, mac: bytes
                     ) -> Optional[tuple[Tenant, str]]:
        """(tenant, key_id) of the key that produced ``mac`` over ``nonce``; None
        otherwise.

        An unknown access_id (or a tenant without keys) is checked against a random
        key, so the answer (and its timing) does not tell which ids exist.
        """
        tenant = self._by_id.get(access_id)
        keys = tenant.keys if tenant is not None and tenant.keys else {
            "": secrets.token_urlsafe(32)}
        found = None
        for kid, key in keys.items():  # every key, also after a match
            if hmac.compare_digest(auth_mac(key, nonce, access_id), mac) and kid:
                found = kid
        if found is None or tenant is None:
            return None
        return tenant, found

    def get(self, access_id: Optional[str]) -> Optional[Tenant]:
        return self._by_id.get(access_id)

    def add(self, tenant: Tenant) -> None:
        """A namespace that the control plane created (``tenant.spec.access_id`` new)."""
        assert tenant.spec.access_id not in self._by_id
        self._by_id[tenant.spec.access_id] = tenant

    def remove(self, access_id: str) -> Optional[Tenant]:
        """Take a namespace out (its connections must be closed; the caller closes it)."""
        return self._by_id.pop(access_id, None)

    def expire(self) -> int:
        """Free reservations older than the TTL in every pool; how many were freed."""
        return sum(t.pool.expire() for t in self._by_id.values())

    def close(self) -> None:
        for tenant in self._by_id.values():
            tenant.close()
