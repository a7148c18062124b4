"""Tenants: who they are (the tenants file, each namespace's quota), one pool and one
memfd per namespace, and the challenge-response check.

:func:`load_tenants` reads the tenants file (secrets, mode 0600); :func:`resolve_quotas`
gives every namespace its pool size: its quota when one is configured, else an equal
share of what the explicit quotas leave of ``capacity``.

Each namespace (a tenant from the tenants file, or the anonymous one) owns a
:class:`~ems.pool.core.Pool` sized by its quota and a memfd of the same size that
holds its bytes. The memfd has no name in any filesystem (``memfd_create``), so it
cannot be opened by guessing; the daemon hands it over (SCM_RIGHTS) only to
connections that authenticated as that tenant. It is sealed against shrinking and
growing, so no client can truncate it under the others (which would make their
copies fault). The daemon itself never maps it: the pool core only does bookkeeping.

**Huge pages** (``huge_pages``, off by default). A segment may be a memfd of the
system's reserved huge pages (``MFD_HUGETLB``; the operator reserves them with
``vm.nr_hugepages``), its size rounded up to whole huge pages. Why: a disk tier's
``O_DIRECT`` read or write gives the device one segment per physically contiguous
piece of memory, and this virtio disk takes 254 segments per request
(``max_segments``). Over 4 KiB pages a 1 MiB value is two requests (254 pages and a
runt of 2); over a 2 MiB page it is one, and a 4 MiB write buffer one instead of four or
more. Measured on the 2-vCPU VM, two alternating pairs each: O_DIRECT reads of a 1 GiB
file in 1 MiB reads, 8 deep, into a memfd of 4 KiB pages 1.56-1.83 GB/s (0.77-1.36
requests per MiB), into huge pages 2.11-2.14 (0.99); through ``ems-server --disk``
(``ems bench --disk``'s tier run), loads after a restart of 1 MiB values 1.32-1.45 ->
1.72-1.76 GB/s and of 256 KiB values 1.31 -> 1.71-1.73, the 1 MiB spill 1.68-1.69 ->
1.78.
``auto`` takes them where enough are free and falls back to 4 KiB pages (logged);
``on`` makes a tenant without them an error (the daemon does not start, the control
plane's tenant is refused).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hmac
import logging
import os
import secrets
import stat
import time
from typing import Callable, Iterable, Mapping, Optional

from ems.config import validate_access_key
from ems.errors import EmsException, invalid
from ems.pool.core import Pool
from ems.protocol import auth_mac
from ems.server.config import ANONYMOUS, HUGE_PAGES, ServerConfig, check_id, read_toml

__all__ = ["Tenant", "TenantRegistry", "TenantSpec", "huge_page_bytes", "load_tenants",
           "meminfo_kib", "resolve_quotas"]

logger = logging.getLogger(__name__)

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def meminfo_kib(field: str, meminfo: str = "/proc/meminfo") -> Optional[int]:
    """The figure of ``field`` in ``/proc/meminfo`` (kB for sizes, a count for
    ``HugePages_*``), None where the file or the field is not there."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def huge_page_bytes() -> Optional[int]:
    """The system's default huge page size (``Hugepagesize``), None where it has none."""
    kib = meminfo_kib("Hugepagesize")
    return kib * 1024 if kib else None


def _segment(name: str, size: int, huge: bool) -> int:
    """A sealed memfd of ``size`` bytes, its memory taken now (``huge``: of huge pages,
    ``size`` a multiple of theirs). OSError when it cannot be had."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        # Take the memory now, as Mooncake's global segment does: a pool that cannot
        # have its capacity fails at start, not mid-save, and clients map it populated
        # (no page fault per 4 KiB page on their first pass). Huge pages short: ENOSPC.
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclasses.dataclass(frozen=True)
class TenantSpec:
    """One namespace: ``access_id`` None is the anonymous one."""

    access_id: Optional[str]
    access_key: Optional[str] = dataclasses.field(repr=False)
    quota_bytes: int

    @property
    def name(self) -> str:
        return self.access_id if self.access_id is not None else ANONYMOUS


def load_tenants(path: str) -> dict[str, str]:
    """Read a tenants file: ``access_id -> access_key``.

    The file is TOML with one table::

        [tenants]
        team-a = "k3Y...32 to 256 chars of 0-9 A-Z a-z + / =..."

    It must be a regular file that neither group nor others can read or write
    (``chmod 600``); otherwise the daemon refuses to start. Ids and keys follow the
    rules of the SDK (``validate_access_id``, ``validate_access_key``), so a client can
    present them.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise invalid(f"tenants file {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise invalid(f"tenants file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise invalid(f"tenants file {path} has mode {stat.S_IMODE(st.st_mode):04o}; it "
                      f"holds secrets and must be 0600 (chmod 600 {path})")
    data = read_toml(path)
    unknown = sorted(set(data) - {"tenants"})
    if unknown or not isinstance(data.get("tenants", {}), dict):
        raise invalid(f"tenants file {path}: expected one [tenants] table of "
                      f"access_id = \"access_key\" (unknown: {', '.join(unknown) or '-'})")
    tenants: dict[str, str] = {}
    for ident, key in data.get("tenants", {}).items():
        check_id(ident, f"tenants file {path}")
        try:
            validate_access_key(key)
        except EmsException as exc:
            raise invalid(f"tenants file {path}: tenant {ident!r}: {exc.message()}") from None
        tenants[ident] = key
    return tenants


def resolve_quotas(config: ServerConfig, tenants: Mapping[str, str]) -> list[TenantSpec]:
    """Give every namespace its pool size (see the module docstring)."""
    unknown = sorted(set(config.quotas_bytes) - set(tenants))
    if unknown:
        raise invalid(f"quotas name access_id(s) not in the tenants file: {', '.join(unknown)}")
    explicit: dict[Optional[str], int] = {k: v for k, v in config.quotas_bytes.items()}
    members: list[Optional[str]] = [t for t in sorted(tenants)]
    if config.anonymous:
        members.append(None)
        if config.anonymous_quota_bytes is not None:
            explicit[None] = config.anonymous_quota_bytes
    if not members:
        raise invalid("no tenants file and anonymous access disabled: nobody could connect")
    fixed = sum(explicit.values())
    if fixed > config.capacity_bytes:
        raise invalid(f"quotas add up to {fixed} bytes, more than capacity "
                      f"{config.capacity_bytes}")
    shared = [m for m in members if m not in explicit]
    share = (config.capacity_bytes - fixed) // len(shared) if shared else 0
    if shared and share < (1 << 20):
        raise invalid(f"capacity leaves {share} bytes each to the {len(shared)} namespace(s) "
                      f"without a quota; raise capacity or set quotas")
    return [TenantSpec(m, None if m is None else tenants[m], explicit.get(m, share))
            for m in members]


def _memfd_name(tenant: str) -> str:
    """A memfd's name (shown in /proc/PID/maps; at most 249 bytes): the tenant's name in
    safe characters, cut short (ids may be 512 characters of any printable kind)."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.@") else "_"
                   for c in tenant[:64])
    return f"ems-pool-{safe}"


class Tenant:
    """A namespace's pool, memory and counters (owned by the daemon's loop)."""

    def __init__(self, spec: TenantSpec, reservation_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic, huge_pages: str = "off"
                 ) -> None:
        """``huge_pages``: one of :data:`HUGE_PAGES` (module doc); OSError when the
        segment cannot be had (``on`` and no huge pages to spare included)."""
        if huge_pages not in HUGE_PAGES:
            raise ValueError(f"huge_pages must be one of {HUGE_PAGES}, got {huge_pages!r}")
        self.spec = spec
        self.name = spec.name
        self.pool = Pool(spec.quota_bytes, reservation_ttl_s=reservation_ttl_s, clock=clock)
        # A random id: segments of a restarted daemon never look like the old ones.
        self.segment_id = secrets.randbits(48)
        #: whether the segment is of huge pages (the report's ``huge_pages``)
        self.huge_pages = False
        name, size = _memfd_name(self.name), self.pool.capacity_bytes
        page = huge_page_bytes() if huge_pages != "off" else None
        fd = -1
        if page:
            huge_size = -(-size // page) * page
            try:
                fd = _segment(name, huge_size, huge=True)
                size, self.huge_pages = huge_size, True
            except OSError as exc:
                if huge_pages == "on":
                    raise OSError(exc.errno, f"no {huge_size >> 20} MiB of huge pages for "
                                  f"tenant {self.name!r} (huge_pages = on; reserve them with "
                                  f"vm.nr_hugepages): {exc.strerror}") from None
                logger.warning("ems-server: tenant %r: no %d MiB of huge pages (%s); its "
                               "shared memory is of 4 KiB pages", self.name, huge_size >> 20,
                               exc.strerror)
        elif huge_pages == "on":
            raise OSError(errno.EINVAL, "huge_pages = on, but this system has no huge pages")
        #: bytes of the memfd (the pool's capacity, rounded up to whole huge pages)
        self.segment_size = size
        self.fd = fd if fd >= 0 else _segment(name, size, huge=False)
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

    def __init__(self, specs: Iterable[TenantSpec], reservation_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic, huge_pages: str = "off"
                 ) -> None:
        #: the daemon's one clock: its pools' reservation TTLs, its handlers' deadlines,
        #: its tiers' (``ems.server.daemon.Daemon`` takes it from here)
        self.clock = clock
        self._by_id: dict[Optional[str], Tenant] = {}
        try:
            for spec in specs:
                self._by_id[spec.access_id] = Tenant(spec, reservation_ttl_s, clock=clock,
                                                     huge_pages=huge_pages)
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
