"""The daemon's cluster tier: the host's pool as the read cache of a Valkey Cluster.

With ``--cluster valkey://...`` the daemon joins a Valkey Cluster that holds the pool
shared by every host (``ems.cluster``). The SDK's calls do not change; their options,
carried by the requests (``ems.protocol.messages``), decide:

* ``load`` / ``exists`` with ``read_local_only`` False (the default): the local pool
  first; for the keys after its leading hits, the home nodes (one pipelined round trip
  per node, nodes in parallel). ``read_local_only`` True: the local pool only.
* ``save`` with ``write_rcache`` True (the default): stored locally as without a
  cluster (visible when the call returns), then written behind to the home node from
  the pool memory (pinned while it is sent). ``write_rcache`` False: sent to the home
  node from the client's slots, which are then freed; the call returns when the home
  node has it, and no local copy is kept.

Where the work runs: the event loop never touches the network. A request that needs
the cluster is handed to a worker thread (``workers``, default 4, for reads and as
many for writes: a load never waits for a worker held by a write), which runs one
:class:`~ems.cluster.client.ClusterClient` batch, and its completion comes back to the
loop (``Loop.call_soon``: the daemon's wake socketpair). The tier implements the
daemon's tier seam (``ems.server.tiers.Tier``): it fills shared memory on a load's
misses (:meth:`ClusterTier.fill`), counts on an exists' misses, writes new objects
behind, takes saves through; the request handlers pin, count and answer.

A remote hit, step by step::

    loop:    acquire local -> leading hits pinned; for the rest, reserve pool space
             (owner: the tier) -> hand the batch to a worker
    worker:  GET per key, pipelined per node; the value is received straight into the
             reserved pool memory (the daemon maps the tenant's memfd), header and
             XXH3-64 checked
    loop:    commit the verified ones (the read cache is filled), abort the others;
             the handler pins the leading run for the client, answers Pinned
    client:  copies pool -> caller, as for any local hit

So a remote hit costs one copy beyond the socket read (pool -> caller), and no Python
``bytes`` per value. ``CcResult.success`` counts the leading hits across both tiers.

Deadlines: each request carries what is left of its deadline (``budget_ms``); the
tiers get 80% of it (``ems.server.handlers.BUDGET_SHARE``: the rest is for the reply
and the client's copy), and a batch never more than ``op_timeout_s`` (2 s) nor half
the reservation TTL (a fetch writes into a reservation, which must not expire under
it). A dead or hung node's keys miss by then;
its circuit breaker then skips it for ``breaker_open_s`` (``ems.cluster.topology``).

Write-behind is bounded: at most ``write_behind_bytes`` (default 256 MiB) in flight
(pinned and being sent); a save past that bound is stored locally only and counted
(``write_behind_dropped``). The time after which another host sees a write-behind is
one batch to the home node (measured in ``tests/cluster``; see the README's cluster section).

A fetch reserves local space for every key it asks for, before it knows which the
cluster has (that keeps it at one round trip): on a full pool that may evict local
LRU objects for keys the cluster then misses. Prefix caches look up first (``exists``,
which reserves nothing) and load what was found, so this stays rare. A key another
request of this host is fetching right now is not fetched twice: the second request
waits for that fetch (the TP ranks of an MLA model load the same blocks at once).

Tenants stay apart: the tenant's name is part of every Valkey key's hash tag, and the
tenant is the one the connection authenticated as, never a client's word.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ClassVar, Optional, Sequence, TypeVar

from ems.cluster import value
from ems.cluster.client import ClusterClient, Op
from ems.cluster.keys import cluster_key
from ems.cluster.topology import ClusterSettings
from ems.pool.core import Pin
from ems.server.config import ServerConfig
from ems.server.fetches import Fetch, FetchBook
from ems.server.memory import SegmentMaps
from ems.server.tenants import Tenant
from ems.server.tiers import Extent, Loop, Report, Tier, TierCounters

__all__ = ["ClusterTier", "TierStatistics", "start"]

logger = logging.getLogger(__name__)

#: Pool owners of what the tier itself holds (fetches in flight, values being sent).
FETCH_OWNER = ("ems-cluster", "fetch")
SEND_OWNER = ("ems-cluster", "send")
_LATENCIES = 512  # recent batch latencies kept for the percentiles of the report
_WARN_EVERY_S = 10.0  # a repeated warning is logged at most this often
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class TierStatistics:
    """Counters of the cluster tier (all tenants together)."""

    lookups: int
    hits: int
    misses: int
    bytes_in: int
    writes: int
    write_errors: int
    bytes_out: int
    write_behind_pending_bytes: int
    write_behind_dropped: int
    batches: int
    latency_p50_ms: float
    latency_p99_ms: float
    latency_max_ms: float


class ClusterTier(Tier):
    """See the module docstring. The hooks run on the event loop; the network I/O on
    the tier's workers."""

    name: ClassVar[str] = "cluster"
    takes_saves_through: ClassVar[bool] = True
    wants_stored: ClassVar[bool] = True

    def __init__(self, settings: ClusterSettings, loop: Loop, workers: int = 4,
                 write_behind_bytes: int = 256 << 20, reservation_ttl_s: float = 60.0) -> None:
        missing = value.available()
        if missing:
            raise RuntimeError(missing)
        self.settings = settings
        self.client = ClusterClient(settings)
        self._loop = loop
        # Reads and writes have workers of their own: a load never waits for a worker
        # held by a write-behind to a node that hangs (the client's lanes keep them
        # apart on the wire; this keeps them apart before it).
        self._readers = ThreadPoolExecutor(workers, thread_name_prefix="ems-cluster-read")
        self._writers = ThreadPoolExecutor(workers, thread_name_prefix="ems-cluster-write")
        self._memory = SegmentMaps()
        self._fetches = FetchBook(FETCH_OWNER)
        self._write_behind_limit = write_behind_bytes
        # A fetch writes into a reservation: it must end well before the pool may
        # expire that reservation and give its space to another key.
        self._max_batch_s = min(settings.op_timeout_s, reservation_ttl_s / 2)
        self._pending_bytes = 0
        self._dropped_logged_at = -_WARN_EVERY_S
        self._lock = threading.Lock()  # the latencies, appended by workers
        #: hits, misses, bytes_in, writes, bytes_out, ... in all and per tenant
        self._counters = TierCounters()
        self._latencies: collections.deque = collections.deque(maxlen=_LATENCIES)

    # ------------------------------------------------------------ plumbing
    def _submit(self, work: Callable[[], _T], done: Callable[[Optional[_T]], None],
                write: bool = False) -> None:
        """Run ``work`` on a reader (``write``: a writer); ``done(result)`` then runs on
        the loop (None when ``work`` raised: the completion still runs, as misses)."""
        def run() -> None:
            started = time.monotonic()
            result: Optional[_T]
            try:
                result = work()
            except Exception:  # noqa: BLE001 - the completion still runs (as misses)
                logger.exception("ems cluster: a batch failed")
                result = None
            self._counters.add(batches=1)
            with self._lock:
                self._latencies.append(time.monotonic() - started)
            self._loop.call_soon(lambda: done(result))
        (self._writers if write else self._readers).submit(run)

    def _deadline(self, deadline: Optional[float]) -> float:
        cap = time.monotonic() + self._max_batch_s
        return cap if deadline is None else min(deadline, cap)

    def tenant_report(self, tenant: Tenant) -> Report:
        """The cluster tier's counters of one tenant (``tiers.cluster`` of its row in
        the daemon's report, which the control plane's status page shows)."""
        return TierCounters.lookups(self._counters.of(tenant))

    # ------------------------------------------------------------ loads
    def fill(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
             deadline: Optional[float], done: Callable[[], None]) -> bool:
        """Fetch the keys after a load's earlier hits into the tenant's pool.

        Each key is either being fetched already by another request of this host (this
        one waits for that fetch: the TP ranks of an MLA model load the same blocks at
        the same moment), or reserved here and fetched by this request's batch; the
        first key that is neither (another writer holds it, no room) ends the run.
        ``done`` runs once every fetch it waits for is over. A load without sizes is
        not fetched (a value's size is needed to reserve its space)."""
        if sizes is None:
            return False
        return self._fetches.plan(tenant, keys, sizes, done,
                                  lambda fetch: self._fetch(fetch, self._deadline(deadline)))

    def _fetch(self, fetch: Fetch, deadline: float) -> None:
        """One batch of GETs into the fetch's reserved pool space."""
        tenant = fetch.tenant
        ops = [Op("get", cluster_key(tenant.name, r.key),
                  target=self._memory.view(tenant, r.grant.offset, r.grant.size),
                  size=r.grant.size) for r in fetch.reserved]

        def work() -> list[bool]:
            self.client.run(ops, deadline)
            return [op.ok for op in ops]

        def done(result: Optional[list[bool]]) -> None:
            ok = result or [False] * len(ops)
            for op in ops:
                if op.target is not None:
                    op.target.release()
            self._counters.add(tenant, lookups=len(ok), hits=sum(ok), misses=len(ok) - sum(ok),
                        bytes_in=sum(r.grant.size for r, hit in zip(fetch.reserved, ok)
                                     if hit))
            self._fetches.finish(fetch, ok)  # every verified value fills the read cache

        self._submit(work, done)

    def count(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
              deadline: Optional[float], done: Callable[[int], None]) -> bool:
        """Count the leading keys the home nodes hold (of the size asked, if given)."""
        ops = [Op("len", cluster_key(tenant.name, k), size=sizes[i])
               if sizes is not None else Op("exists", cluster_key(tenant.name, k))
               for i, k in enumerate(keys)]
        limit = self._deadline(deadline)

        def work() -> list[bool]:
            self.client.run(ops, limit)
            return [op.ok for op in ops]

        def counted(result: Optional[list[bool]]) -> None:
            ok = result or []
            leading = 0
            while leading < len(ok) and ok[leading]:
                leading += 1
            done(leading)

        self._submit(work, counted)
        return True

    # ------------------------------------------------------------ saves
    def stored(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int],
               hashes: Optional[Sequence[Optional[int]]] = None) -> None:
        """Send freshly stored local values to their home nodes (pinned meanwhile)."""
        pool = tenant.pool
        total = sum(sizes)
        if self._pending_bytes + total > self._write_behind_limit:
            self._counters.add(write_behind_dropped=len(keys))
            now = time.monotonic()
            if now - self._dropped_logged_at > _WARN_EVERY_S:
                self._dropped_logged_at = now
                logger.warning("ems cluster: write-behind bound reached (%d bytes in flight, "
                               "bound %d, --cluster-write-behind): saves stay local only "
                               "until it drains (counted as write_behind_dropped)",
                               self._pending_bytes, self._write_behind_limit)
            return
        sent_keys: list[str] = []
        pins: list[Pin] = []
        for k, s in zip(keys, sizes):
            got = pool.acquire([k], [s], SEND_OWNER, count=False)
            if got:
                sent_keys.append(k)
                pins.append(got[0])
        if not pins:
            return
        held = sum(p.size for p in pins)
        self._pending_bytes += held

        def sent(ok: list[bool]) -> None:
            pool.release([p.token for p in pins], SEND_OWNER)
            self._pending_bytes -= held

        self._send(tenant, sent_keys, [Extent(p.offset, p.size) for p in pins],
                   time.monotonic() + self.settings.op_timeout_s, sent)

    def save_through(self, tenant: Tenant, keys: Sequence[str], extents: Sequence[Extent],
                     deadline: Optional[float], done: Callable[[list[bool]], None]) -> bool:
        """A save with ``write_rcache`` False: to the home nodes only (no local copy)."""
        self._send(tenant, keys, extents, self._deadline(deadline), done)
        return True

    def _send(self, tenant: Tenant, keys: Sequence[str], extents: Sequence[Extent],
              deadline: float, then: Callable[[list[bool]], None]) -> None:
        """SET each key from its pool memory, then ``then(ok)`` on the loop."""
        ckeys = [cluster_key(tenant.name, k) for k in keys]
        views = [self._memory.view(tenant, e.offset, e.size) for e in extents]

        def work() -> list[bool]:
            ops = [Op("set", ck, parts=[value.header(ck, v), v]) for ck, v in zip(ckeys, views)]
            self.client.run(ops, deadline)
            return [op.ok for op in ops]

        def done(result: Optional[list[bool]]) -> None:
            ok = result or [False] * len(keys)
            good = sum(ok)
            self._counters.add(tenant, writes=good, write_errors=len(ok) - good,
                        bytes_out=sum(len(v) for v, hit in zip(views, ok) if hit))
            for v in views:
                v.release()
            then(ok)

        self._submit(work, done, write=True)

    # ------------------------------------------------------------ report
    def statistics(self) -> TierStatistics:
        c = self._counters.totals()
        with self._lock:
            lat = sorted(self._latencies)

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else 0.0
        return TierStatistics(
            lookups=c.get("lookups", 0), hits=c.get("hits", 0), misses=c.get("misses", 0),
            bytes_in=c.get("bytes_in", 0), writes=c.get("writes", 0),
            write_errors=c.get("write_errors", 0), bytes_out=c.get("bytes_out", 0),
            write_behind_pending_bytes=self._pending_bytes,
            write_behind_dropped=c.get("write_behind_dropped", 0),
            batches=c.get("batches", 0), latency_p50_ms=pct(0.5), latency_p99_ms=pct(0.99),
            latency_max_ms=round(lat[-1] * 1000, 3) if lat else 0.0)

    def report(self) -> Report:
        st = self.statistics()
        row = dataclasses.asdict(st)
        lookups = st.hits + st.misses
        row["hit_rate"] = st.hits / lookups if lookups else 0.0
        nodes = self.client.slots.rows()
        return {"seeds": [f"{h}:{p}" for h, p in self.settings.seeds], "tls": self.settings.tls,
                "state": "down" if self.client.down_logged else "ok", "tier": row,
                "redirects": dict(self.client.redirects), "nodes": nodes}

    def close(self) -> None:
        """Stop the workers (their batches end by their deadlines; their completions
        are queued on the loop, which runs them next), then the client."""
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self.client.close()
        self._loop.call_soon(self._memory.close)  # after the completions queued before


def start(config: ServerConfig, loop: Loop) -> ClusterTier:
    """The tier of a daemon's ``config`` (``cluster`` set); raises RuntimeError when it
    cannot run (the checksum package missing)."""
    from ems.cluster.topology import parse_url
    assert config.cluster is not None
    settings = parse_url(config.cluster, config.cluster_ca_file,
                         config.cluster_cert_file, config.cluster_key_file)
    if config.cluster_password:
        settings = dataclasses.replace(settings, password=config.cluster_password)
    tier = ClusterTier(settings, loop, write_behind_bytes=config.cluster_write_behind_bytes,
                       reservation_ttl_s=config.reservation_ttl_s)
    logger.info("ems-server: cluster tier on %s (%s), write-behind bound %d MiB",
                ",".join(f"{h}:{p}" for h, p in settings.seeds),
                "TLS" if settings.tls else "plain TCP", config.cluster_write_behind_bytes >> 20)
    return tier
