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
loop (``Loop.call_soon``: the daemon's wake socketpair). This module is the engine
only (``ems.server.tier_driver.Engine``: a fetch's keys read in one pipelined batch,
a save's keys written in one, presence probed); the tier driver keeps the books
around it (the workers, the fetches and their de-duplication, the pins and the
write-behind bound, the deadlines, the counters and latencies), and the request
handlers pin, count and answer.

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
one batch to the home node (measured in ``tests/cluster``; see docs/tiers/cluster.md).

A fetch reserves local space for every key it asks for, before it knows which the
cluster has (that keeps it at one round trip): on a full pool that may evict local
LRU objects for keys the cluster then misses. Prefix caches look up first (``exists``,
which reserves nothing) and load what was found, so this stays rare. A key another
request of this host is fetching right now is not fetched twice: the second request
waits for that fetch (the TP ranks of an MLA model load the same blocks at once).

Tenants stay apart: the tenant's name is part of every Valkey key's hash tag, and the
tenant is the one the connection authenticated as, never a client's word.

KV events (``--kv-events``), medium ``ems-cluster`` (CPU, REMOTE), as far as this host
knows: a write-behind or a save written through that the home node took ->
``BlockStored`` (the hashes the save brought); a key this host wrote that a home node
then answers it does not hold (a nil GET, STRLEN or EXISTS 0: Valkey evicted it, or
another host deleted it) -> ``BlockRemoved``. A miss by a timeout, an error or a node
down says nothing of the key and publishes nothing. Valkey evicts without telling
anyone, so a block this host wrote and never asks for again stays announced; routers
weigh the cluster below the host's own tiers (``examples/kv_router.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, ClassVar, Optional, Sequence

from ems.cluster import value
from ems.cluster.client import ClusterClient, Op
from ems.cluster.keys import cluster_key
from ems.cluster.topology import ClusterSettings
from ems.protocol.report import ClusterReport, ClusterTierRow
from ems.server.config import ServerConfig
from ems.server.tenants import Tenant
from ems.server.tier_driver import (
    WRITTEN,
    DriverSettings,
    DriverStatistics,
    Engine,
    ReadOutcome,
    Sources,
    Target,
    TierDriver,
    Written,
)
from ems.server.tiers import Loop, TierEvents

__all__ = ["ClusterEngine", "start"]

logger = logging.getLogger(__name__)

#: the cluster's name in KV events (``ems.server.kv_events.MEDIUMS``)
MEDIUM = "ems-cluster"

_FAILED = Written(False, "error")


class ClusterEngine(Engine):
    """See the module docstring: the home nodes of a Valkey Cluster behind the tier
    driver (one batch per request, pipelined per node, nodes in parallel)."""

    name: ClassVar[str] = "cluster"
    takes_saves_through: ClassVar[bool] = True
    parallel_reads: ClassVar[bool] = False
    batch_writes: ClassVar[bool] = True

    def __init__(self, settings: ClusterSettings, events: Optional[TierEvents] = None
                 ) -> None:
        missing = value.available()
        if missing:
            raise RuntimeError(missing)
        self.settings = settings
        self.events = events
        self.client = ClusterClient(settings)

    def _absent(self, tenant: Tenant, keys: Sequence[str], ops: Sequence[Op]) -> None:
        """``BlockRemoved(ems-cluster)`` of the keys a home node said it does not hold
        (the publisher names only those this host announced there)."""
        if self.events is not None:
            gone = [k for k, op in zip(keys, ops) if op.absent]
            if gone:
                self.events.tier_removed(tenant.name, gone, MEDIUM, any_writer=True)

    def probe(self, tenant: Tenant, keys: Sequence[str], sizes: Optional[Sequence[int]],
              deadline: float) -> list[bool]:
        """Which keys the home nodes hold (of the size asked, if given)."""
        ops = [Op("len", cluster_key(tenant.name, k), size=sizes[i])
               if sizes is not None else Op("exists", cluster_key(tenant.name, k))
               for i, k in enumerate(keys)]
        self.client.run(ops, deadline)
        self._absent(tenant, keys, ops)
        return [op.ok for op in ops]

    def read_batch(self, tenant: Tenant, targets: Sequence[Target], deadline: float
                   ) -> list[ReadOutcome]:
        """GET per key, received straight into the target memory (checked)."""
        ops = [Op("get", cluster_key(tenant.name, t.key), target=t.memory,
                  size=len(t.memory)) for t in targets]
        self.client.run(ops, deadline)
        self._absent(tenant, [t.key for t in targets], ops)
        return [ReadOutcome.HIT if op.ok else ReadOutcome.MISS for op in ops]

    def read(self, tenant: Tenant, target: Target, deadline: float) -> ReadOutcome:
        return self.read_batch(tenant, [target], deadline)[0]

    def write_batch(self, tenant: Tenant, sources: Sources, deadline: Optional[float]
                    ) -> list[Written]:
        """SET each key from its memory (header and value, no copy)."""
        ops = []
        for key, memory in zip(sources.keys, sources.memories):
            ck = cluster_key(tenant.name, key)
            ops.append(Op("set", ck, parts=[value.header(ck, memory), memory]))
        assert deadline is not None  # the driver's write_out_s / max_op_s
        self.client.run(ops, deadline)
        if self.events is not None:
            took = [t for t, op in zip(sources.targets(), ops) if op.ok]
            if took:
                hashes = [t.hash for t in took]
                self.events.tier_stored(
                    tenant.name, [t.key for t in took], MEDIUM,
                    hashes if any(h is not None for h in hashes) else None)
        return [WRITTEN if op.ok else _FAILED for op in ops]

    def write(self, tenant: Tenant, source: Target, deadline: Optional[float]) -> Written:
        return self.write_batch(tenant, Sources([source.key], [source.memory],
                                                [source.hash]), deadline)[0]

    def statistics(self, books: DriverStatistics) -> ClusterTierRow:
        """The tier's counters of all tenants together."""
        return books.tier_row(
            ClusterTierRow, lookups=books.lookups, write_errors=sum(books.refused.values()),
            write_behind_pending_bytes=books.inflight_bytes,
            write_behind_dropped=books.dropped, batches=books.batches,
            latency_p50_ms=books.latency_p50_ms, latency_p99_ms=books.latency_p99_ms,
            latency_max_ms=books.latency_max_ms)

    def report(self, books: DriverStatistics) -> ClusterReport:
        return ClusterReport(
            seeds=[f"{h}:{p}" for h, p in self.settings.seeds], tls=self.settings.tls,
            state="down" if self.client.down_logged else "ok", tier=self.statistics(books),
            redirects=dict(self.client.redirects), nodes=self.client.slots.rows())

    def close(self) -> None:
        self.client.close()


def start(config: ServerConfig, loop: Loop, events: Optional[TierEvents] = None,
          workers: int = 4, clock: Callable[[], float] = time.monotonic) -> TierDriver:
    """The tier of a daemon's ``config`` (``cluster`` set), telling ``events`` (KV
    events) what it stores and finds gone, its deadlines on ``clock`` (the daemon's);
    raises RuntimeError when it cannot run (the checksum package missing)."""
    from ems.cluster.topology import parse_url
    assert config.cluster is not None
    settings = parse_url(config.cluster, config.cluster_ca_file,
                         config.cluster_cert_file, config.cluster_key_file)
    if config.cluster_password:
        settings = dataclasses.replace(settings, password=config.cluster_password)
    # A fetch writes into a reservation: it must end well before the pool may expire
    # that reservation and give its space to another key.
    tier = TierDriver(ClusterEngine(settings, events), loop, DriverSettings(
        read_workers=workers, write_workers=workers,
        max_op_s=min(settings.op_timeout_s, config.reservation_ttl_s / 2),
        write_out_s=settings.op_timeout_s,
        inflight_bytes=config.cluster_write_behind_bytes, queue_bytes=0,
        bound_setting="--cluster-write-behind"), clock=clock)
    logger.info("ems-server: cluster tier on %s (%s), write-behind bound %d MiB",
                ",".join(f"{h}:{p}" for h, p in settings.seeds),
                "TLS" if settings.tls else "plain TCP", config.cluster_write_behind_bytes >> 20)
    return tier
