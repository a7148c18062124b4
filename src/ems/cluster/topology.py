"""Where each hash slot lives: the cluster's seeds, its slot map, and each node's health.

:func:`parse_url` reads ``valkey://[user:password@]HOST:PORT[,HOST:PORT...]``
(``valkeys://``: TLS; :func:`tls_context` builds the daemon's TLS context from the CA
file and, for a cluster that verifies its clients (Redis' and Valkey's default
``tls-auth-clients yes``), the daemon's own certificate). The slot map comes from
``CLUSTER SLOTS`` of any reachable node (:meth:`SlotMap.load`) and is patched by
``MOVED`` answers between refreshes.

Each node has a circuit breaker::

    CLOSED --(BREAKER_FAILURES failures in a row)--> OPEN --(BREAKER_OPEN_S later)--> HALF
      ^                                                                              |
      +-------------------------(the next request to it succeeds)--------------------+
                                 (it fails: OPEN again)

While OPEN, the node's keys miss at once, without a connect or a timeout: a dead or
hung node costs the first ``BREAKER_FAILURES`` requests their timeout, and none after
(every ``BREAKER_OPEN_S`` one request probes it again).
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
import threading
import time
import urllib.parse
from typing import Optional

from ems.cluster.keys import SLOTS
from ems.errors import invalid
from ems.protocol.report import ClusterNodeRow

__all__ = ["Addr", "BREAKER_FAILURES", "BREAKER_OPEN_S", "ClusterSettings", "NodeHealth",
           "SlotMap", "parse_url", "tls_context"]

logger = logging.getLogger(__name__)

Addr = tuple[str, int]

#: Failures in a row that open a node's breaker.
BREAKER_FAILURES = 2
#: How long an open breaker skips its node.
BREAKER_OPEN_S = 2.0


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    """How the daemon reaches the cluster (server side only: never sent to clients)."""

    seeds: tuple[Addr, ...]
    username: Optional[str] = dataclasses.field(default=None, repr=False)
    password: Optional[str] = dataclasses.field(default=None, repr=False)
    tls: bool = False
    #: CA bundle for TLS (None: the system's)
    ca_file: Optional[str] = None
    #: the daemon's certificate (PEM; its key too unless ``key_file``) for a cluster
    #: that verifies its clients (None: no client certificate)
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    #: bound of a request that has no deadline (timeout=0), and of any one request
    op_timeout_s: float = 2.0
    #: bound of one connect (also within the request's deadline)
    connect_timeout_s: float = 0.5
    #: least time between two slot-map refreshes
    refresh_s: float = 0.5
    #: MOVED/ASK rounds one request follows
    max_redirects: int = 3
    breaker_failures: int = BREAKER_FAILURES
    breaker_open_s: float = BREAKER_OPEN_S

    def __post_init__(self) -> None:
        if not self.seeds:
            raise invalid("cluster needs at least one HOST:PORT seed")
        if not 0 < self.op_timeout_s <= 600 or not 0 < self.connect_timeout_s <= 60:
            raise invalid("cluster timeouts must be > 0 (op <= 600 s, connect <= 60 s)")
        if not self.tls:
            given = [n for n in ("ca_file", "cert_file", "key_file") if getattr(self, n)]
            if given:  # never a silent plain-text connection the user believes is TLS
                raise invalid(f"cluster_{given[0]} is set but the cluster URL is "
                              f"valkey:// (plain TCP); use valkeys:// for TLS")
        if self.key_file and not self.cert_file:
            raise invalid("cluster_key_file needs cluster_cert_file (the certificate)")


def parse_url(url: str, ca_file: Optional[str] = None, cert_file: Optional[str] = None,
              key_file: Optional[str] = None) -> ClusterSettings:
    """Settings of ``valkey://[user:password@]HOST:PORT[,HOST:PORT...]`` (``valkeys://``:
    TLS). Raises ``EMS_INVALID_ARGUMENT`` naming ``cluster`` and the rule."""
    if not isinstance(url, str) or "://" not in url:
        raise invalid(f"cluster must be valkey://HOST:PORT[,HOST:PORT...], got {url!r}")
    scheme, rest = url.split("://", 1)
    if scheme not in ("valkey", "valkeys", "redis", "rediss"):
        raise invalid(f"cluster must start with valkey:// or valkeys:// (TLS), got {scheme!r}")
    username = password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, sep, pw = cred.partition(":")
        username = urllib.parse.unquote(user) or None if sep else None
        password = urllib.parse.unquote(pw if sep else user)
    rest = rest.rstrip("/")
    seeds = []
    for item in rest.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise invalid(f"cluster seed {item!r} must be HOST:PORT")
        seeds.append((host.strip("[]"), int(port)))
    return ClusterSettings(tuple(seeds), username, password, scheme in ("valkeys", "rediss"),
                           ca_file, cert_file, key_file)


def tls_context(settings: ClusterSettings) -> Optional[ssl.SSLContext]:
    """The client TLS context of ``settings`` (None without TLS): the server's
    certificate verified against ``ca_file`` (or the system's CAs) and its name (or IP
    address) checked against the seed's host; ``cert_file``/``key_file`` presented when
    set. A file that cannot be read or parsed is ``EMS_INVALID_ARGUMENT`` naming it."""
    if not settings.tls:
        return None
    try:
        ctx = ssl.create_default_context(cafile=settings.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise invalid(f"cluster_ca_file {settings.ca_file!r} is not a readable PEM CA "
                      f"bundle: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.cert_file:
        try:
            ctx.load_cert_chain(settings.cert_file, settings.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise invalid(f"cluster_cert_file {settings.cert_file!r} / cluster_key_file "
                          f"{settings.key_file!r} must be a readable PEM certificate and "
                          f"its key: {exc}") from exc
    return ctx


class NodeHealth:
    """One node's breaker and counters (updated under the map's lock)."""

    def __init__(self, addr: Addr) -> None:
        self.addr = addr
        self.failures = 0
        self.open_until = 0.0
        self.last_error = ""
        self.ops = self.errors = self.skipped = 0
        self.bytes_in = self.bytes_out = 0

    def state(self, now: float) -> str:
        if self.open_until > now:
            return "open"
        return "half-open" if self.failures >= BREAKER_FAILURES else "closed"


class SlotMap:
    """slot -> primary address, plus every known node's health (thread-safe)."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._slots: list[Optional[Addr]] = [None] * SLOTS
        self._health: dict[Addr, NodeHealth] = {}
        self.refreshed_at = 0.0
        self.stale = True
        self.loaded = False  # a CLUSTER SLOTS answer was installed once
        self.epoch = 0  # bumped by every change

    # ------------------------------------------------------------ queries
    def node_of(self, slot: int) -> Optional[Addr]:
        return self._slots[slot]

    def known(self) -> list[Addr]:
        with self._lock:
            nodes = {a for a in self._slots if a is not None} | set(self._health)
        return sorted(nodes)

    def health(self, addr: Addr) -> NodeHealth:
        with self._lock:
            h = self._health.get(addr)
            if h is None:
                h = self._health[addr] = NodeHealth(addr)
            return h

    def usable(self, addr: Addr, now: float) -> bool:
        """False while the node's breaker is open (its keys miss without I/O)."""
        h = self.health(addr)
        if h.open_until > now:
            with self._lock:
                h.skipped += 1
            return False
        return True

    # ------------------------------------------------------------ updates
    def ok(self, addr: Addr) -> None:
        h = self.health(addr)
        with self._lock:
            if h.failures >= self.settings.breaker_failures:
                logger.info("ems cluster: node %s:%d answers again", *addr)
            h.failures = 0
            h.open_until = 0.0

    def failed(self, addr: Addr, why: str) -> None:
        h = self.health(addr)
        with self._lock:
            h.failures += 1
            h.errors += 1
            h.last_error = why
            self.stale = True
            if h.failures >= self.settings.breaker_failures:
                if h.open_until <= time.monotonic():
                    logger.warning("ems cluster: node %s:%d failed %d times (%s); skipping "
                                   "it for %.1f s", addr[0], addr[1], h.failures, why,
                                   self.settings.breaker_open_s)
                h.open_until = time.monotonic() + self.settings.breaker_open_s

    def moved(self, slot: int, addr: Addr) -> None:
        with self._lock:
            self._slots[slot] = addr
            self.stale = True
            self.epoch += 1

    def load(self, reply: list) -> int:
        """Install a ``CLUSTER SLOTS`` reply; how many slots are covered."""
        slots: list[Optional[Addr]] = [None] * SLOTS
        covered = 0
        for entry in reply:
            start, end, primary = int(entry[0]), int(entry[1]), entry[2]
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            addr = (host or self.settings.seeds[0][0], int(primary[1]))
            for s in range(max(0, start), min(SLOTS - 1, end) + 1):
                slots[s] = addr
                covered += 1
            self.health(addr)
        with self._lock:
            self._slots = slots
            self.refreshed_at = time.monotonic()
            self.stale = False
            self.loaded = True
            self.epoch += 1
        return covered

    def rows(self) -> list[ClusterNodeRow]:
        """Per node: address, slots it serves, breaker state and counters (stats)."""
        now = time.monotonic()
        with self._lock:
            counts: dict[Addr, int] = {}
            for a in self._slots:
                if a is not None:
                    counts[a] = counts.get(a, 0) + 1
            out = []
            for addr in sorted(set(counts) | set(self._health)):
                h = self._health.get(addr) or NodeHealth(addr)
                out.append(ClusterNodeRow(
                    node=f"{addr[0]}:{addr[1]}", slots=counts.get(addr, 0),
                    state=h.state(now), ops=h.ops, errors=h.errors, skipped=h.skipped,
                    bytes_in=h.bytes_in, bytes_out=h.bytes_out, last_error=h.last_error))
        return out
