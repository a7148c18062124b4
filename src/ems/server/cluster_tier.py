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
the cluster is handed to a worker thread (``workers``, default 4), which runs one
:class:`~ems.cluster.client.ClusterClient` batch, and its completion comes back to the
loop through the daemon's wake socketpair (:meth:`ClusterTier.drain` runs it there).

A remote hit, step by step::

    loop:    acquire local -> leading hits pinned; for the rest, reserve pool space
             (owner: the tier) -> hand the batch to a worker
    worker:  GET per key, pipelined per node; the value is received straight into the
             reserved pool memory (the daemon maps the tenant's memfd), header and
             XXH3-64 checked
    loop:    commit the verified ones (the read cache is filled), abort the others,
             pin the leading run for the client, answer Pinned
    client:  copies pool -> caller, as for any local hit

So a remote hit costs one copy beyond the socket read (pool -> caller), and no Python
``bytes`` per value. ``CcResult.success`` counts the leading hits across both tiers.

Deadlines: each request carries what is left of its deadline (``budget_ms``); the
tier's batch gets 80% of it (the rest is for the reply and the client's copy), and
never more than ``op_timeout_s`` (2 s) nor half the reservation TTL (a fetch writes
into a reservation, which must not expire under it). A dead or hung node's keys miss by then;
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
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from ems.cluster import value
from ems.cluster.client import ClusterClient, Op
from ems.cluster.keys import cluster_key
from ems.cluster.topology import ClusterSettings
from ems.pool.core import GrantStatus, Pool
from ems.protocol import messages as m

__all__ = ["ClusterTier", "TierStatistics"]

logger = logging.getLogger(__name__)

#: Pool owners of what the tier itself holds (fetches in flight, values being sent).
FETCH_OWNER = ("ems-cluster", "fetch")
SEND_OWNER = ("ems-cluster", "send")
#: Share of a request's remaining time given to its cluster batch.
BUDGET_SHARE = 0.8
_LATENCIES = 512  # recent batch latencies kept for the percentiles of the report
_WARN_EVERY_S = 10.0  # a repeated warning is logged at most this often


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


class ClusterTier:
    """See the module docstring. Loop-side methods are called from the event loop only;
    ``reply(conn, cls, *fields)`` answers a connection if it is still open."""

    def __init__(self, settings: ClusterSettings, wake: Callable[[], None],
                 reply: Callable[..., None], lease: Callable[[Pool, Any], tuple[int, int]],
                 workers: int = 4, write_behind_bytes: int = 256 << 20,
                 reservation_ttl_s: float = 60.0) -> None:
        missing = value.available()
        if missing:
            raise RuntimeError(missing)
        self.settings = settings
        self.client = ClusterClient(settings)
        self._wake = wake
        self._reply = reply
        self._lease = lease
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="ems-cluster-io")
        self._done: collections.deque = collections.deque()
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self._reserved: dict[int, dict[int, tuple[str, int, int, bool]]] = {}
        #: (tenant, key) -> the fetch that is getting it now (others wait for it)
        self._inflight: dict[tuple[int, str], _Fetch] = {}
        self._write_behind_limit = write_behind_bytes
        # A fetch writes into a reservation: it must end well before the pool may
        # expire that reservation and give its space to another key.
        self._max_batch_s = min(settings.op_timeout_s, reservation_ttl_s / 2)
        self._pending_bytes = 0
        self._dropped_logged_at = -_WARN_EVERY_S
        self._lock = threading.Lock()  # counters updated by workers
        self._c: collections.Counter = collections.Counter()
        #: per tenant (by name): hits, misses, bytes_in, writes, bytes_out
        self._per_tenant: dict[str, collections.Counter] = {}
        self._latencies: collections.deque = collections.deque(maxlen=_LATENCIES)
        self._closed = False

    # ------------------------------------------------------------ plumbing
    def _memory(self, tenant: Any) -> memoryview:
        """The tenant's pool memory, mapped once (MAP_SHARED over its memfd). Keyed by
        the segment's random id, never by ``id(tenant)``: a tenant removed by the
        control plane and a new one at the same address must not share a mapping."""
        entry = self._maps.get(tenant.segment_id)
        if entry is None:
            mm = mmap.mmap(tenant.fd, tenant.segment_size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            entry = self._maps[tenant.segment_id] = (mm, memoryview(mm))
        return entry[1]

    def _submit(self, work: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """Run ``work`` on a worker; ``done(result)`` then runs on the loop."""
        def run() -> None:
            started = time.monotonic()
            try:
                result = work()
            except Exception:  # noqa: BLE001 - the completion still runs (as misses)
                logger.exception("ems cluster: a batch failed")
                result = None
            with self._lock:
                self._c["batches"] += 1
                self._latencies.append(time.monotonic() - started)
            self._done.append((done, result))
            self._wake()
        self._executor.submit(run)

    def drain(self) -> None:
        """Run the completions the workers handed back (on the loop)."""
        while self._done:
            done, result = self._done.popleft()
            try:
                done(result)
            except Exception:  # noqa: BLE001 - a bug must not stop the daemon
                logger.exception("ems cluster: a completion failed")

    def _deadline(self, budget_ms: int) -> float:
        budget = budget_ms / 1000 * BUDGET_SHARE if budget_ms else self._max_batch_s
        return time.monotonic() + min(budget, self._max_batch_s)

    def _count(self, tenant: Any = None, **kw: int) -> None:
        with self._lock:
            self._c.update(kw)
            if tenant is not None:
                row = self._per_tenant.get(tenant.name)
                if row is None:
                    row = self._per_tenant[tenant.name] = collections.Counter()
                row.update(kw)

    def tenant_tier(self, tenant: Any) -> dict[str, Any]:
        """The cluster tier's counters of one tenant (``tiers.cluster`` of its row in
        the daemon's report, which the control plane's status page shows)."""
        with self._lock:
            row = dict(self._per_tenant.get(tenant.name, {}))
        hits, misses = row.get("hits", 0), row.get("misses", 0)
        return {"hits": hits, "misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "bytes_in": row.get("bytes_in", 0), "writes": row.get("writes", 0),
                "bytes_out": row.get("bytes_out", 0)}

    # ------------------------------------------------------------ loads
    def acquire(self, conn: Any, tenant: Any, rid: int, keys: list[str], sizes: list[int],
                pins: list, budget_ms: int) -> None:
        """Answer an Acquire whose local pins are ``pins`` (fewer than ``keys``).

        Each key after the local hits is either being fetched already by another
        request of this host (this one waits for that fetch: the TP ranks of an MLA
        model load the same blocks at the same moment), or reserved here and fetched
        by this request's batch; the first key that is neither (another writer holds
        it, no room) ends the run. Once every fetch it waits for is done, the leading
        run is pinned for the client and the request is answered."""
        pool: Pool = tenant.pool
        n = len(pins)
        tid = tenant.segment_id
        waits: list[_Fetch] = []
        mine: list[tuple[str, Any]] = []
        considered = 0
        for key, size in zip(keys[n:], sizes[n:]):
            fetch = self._inflight.get((tid, key))
            if fetch is not None:
                if fetch not in waits:
                    waits.append(fetch)
            else:
                grant = pool.reserve([key], [size], FETCH_OWNER)[0]
                if grant.status is not GrantStatus.NEW:
                    break
                mine.append((key, grant))
            considered += 1
        if not considered:
            self._answer_pins(conn, rid, pins)
            return
        if mine:
            fetch = self._fetch(tenant, mine, self._deadline(budget_ms))
            waits.append(fetch)
        request = _Waiting(conn, tenant, rid, keys[n:n + considered],
                           sizes[n:n + considered], list(pins), len(waits))
        for fetch in waits:
            fetch.waiters.append(request)

    def _fetch(self, tenant: Any, grants: list[tuple[str, Any]], deadline: float
               ) -> "_Fetch":
        """Start one batch of GETs into reserved pool space; registered as in flight."""
        pool: Pool = tenant.pool
        memory = self._memory(tenant)
        ops = [Op("get", cluster_key(tenant.name, k), target=memory[g.offset:g.offset + g.size],
                  size=g.size) for k, g in grants]
        fetch = _Fetch()
        tid = tenant.segment_id
        for key, _ in grants:
            self._inflight[(tid, key)] = fetch

        def work() -> list[Op]:
            self.client.run(ops, deadline)
            return ops

        def done(_: Any) -> None:
            ok = [op.ok for op in ops]
            for op in ops:
                op.target.release()  # type: ignore[union-attr]
            pool.commit([g.token for (_, g), hit in zip(grants, ok) if hit], FETCH_OWNER)
            pool.abort([g.token for (_, g), hit in zip(grants, ok) if not hit], FETCH_OWNER)
            for key, _ in grants:  # every verified value has filled the read cache
                self._inflight.pop((tid, key), None)
            self._count(tenant, lookups=len(ok), hits=sum(ok), misses=len(ok) - sum(ok),
                        bytes_in=sum(g.size for (_, g), hit in zip(grants, ok) if hit))
            for request in fetch.waiters:
                request.pending -= 1
                if request.pending == 0:
                    self._finish(request)

        self._submit(work, done)
        return fetch

    def _finish(self, w: "_Waiting") -> None:
        """All fetches ``w`` waited for are done: pin its leading run, answer it."""
        more: list = []
        conn: Any = w.conn
        tenant: Any = w.tenant
        pool: Pool = tenant.pool
        if getattr(conn, "tenant", None) is tenant and _open(conn):
            more = pool.acquire(w.keys, w.sizes, conn.id, count=False)
            conn.pins += len(more)  # the daemon's per-connection pin limit counts them
        self._answer_pins(w.conn, w.rid, w.pins + more)

    def _answer_pins(self, conn: Any, rid: int, pins: Sequence[Any]) -> None:
        self._reply(conn, m.Pinned.wire(rid=rid, tokens=[p.token for p in pins],
                                        offsets=[p.offset for p in pins],
                                        sizes=[p.size for p in pins]))

    def exists(self, conn: Any, tenant: Any, rid: int, keys: list[str],
               sizes: Optional[list[int]], n: int, budget_ms: int) -> None:
        """Answer an Exists whose local leading count is ``n`` (< len(keys))."""
        ops = [Op("len", cluster_key(tenant.name, k), size=sizes[n + i])
               if sizes is not None else Op("exists", cluster_key(tenant.name, k))
               for i, k in enumerate(keys[n:])]
        deadline = self._deadline(budget_ms)

        def work() -> list[Op]:
            self.client.run(ops, deadline)
            return ops

        def done(_: Any) -> None:
            leading = 0
            while leading < len(ops) and ops[leading].ok:
                leading += 1
            self._reply(conn, m.Count.wire(rid=rid, n=n + leading))

        self._submit(work, done)

    # ------------------------------------------------------------ saves
    def write_behind(self, tenant: Any, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Send freshly stored local values to their home nodes (pinned meanwhile)."""
        pool: Pool = tenant.pool
        total = sum(sizes)
        if self._pending_bytes + total > self._write_behind_limit:
            self._count(write_behind_dropped=len(keys))
            now = time.monotonic()
            if now - self._dropped_logged_at > _WARN_EVERY_S:
                self._dropped_logged_at = now
                logger.warning("ems cluster: write-behind bound reached (%d bytes in flight, "
                               "bound %d, --cluster-write-behind): saves stay local only "
                               "until it drains (counted as write_behind_dropped)",
                               self._pending_bytes, self._write_behind_limit)
            return
        pins = []
        for k, s in zip(keys, sizes):
            got = pool.acquire([k], [s], SEND_OWNER, count=False)
            if got:
                pins.append((k, got[0]))
        if not pins:
            return
        self._pending_bytes += sum(p.size for _, p in pins)
        memory = self._memory(tenant)
        self._send(tenant, [k for k, _ in pins], [memory[p.offset:p.offset + p.size]
                                                  for _, p in pins],
                   time.monotonic() + self.settings.op_timeout_s,
                   lambda ok: self._sent_behind(pool, pins))

    def _sent_behind(self, pool: Pool, pins: list) -> None:
        pool.release([p.token for _, p in pins], SEND_OWNER)
        self._pending_bytes -= sum(p.size for _, p in pins)

    def _send(self, tenant: Any, keys: Sequence[str], views: list[memoryview],
              deadline: float, then: Callable[[list[bool]], None]) -> None:
        """SET each key from its pool memory (``views``), then ``then(ok)`` on the loop."""
        ckeys = [cluster_key(tenant.name, k) for k in keys]

        def work() -> list[bool]:
            ops = [Op("set", ck, parts=[value.header(ck, v), v]) for ck, v in zip(ckeys, views)]
            self.client.run(ops, deadline)
            return [op.ok for op in ops]

        def done(ok: Optional[list[bool]]) -> None:
            ok = ok or [False] * len(keys)
            good = sum(ok)
            self._count(tenant, writes=good, write_errors=len(ok) - good,
                        bytes_out=sum(len(v) for v, hit in zip(views, ok) if hit))
            for v in views:
                v.release()
            then(ok)

        self._submit(work, done)

    def put_through(self, conn: Any, tenant: Any, rid: int, keys: list[str],
                    offsets: list[int], sizes: list[int], want_lease: bool,
                    budget_ms: int) -> None:
        """A Put with ``write_rcache`` False: send the lease ranges to the home nodes,
        give them back, answer when the nodes have them (no local copy)."""
        pool: Pool = tenant.pool
        memory = self._memory(tenant)
        views = [memory[o:o + s] for o, s in zip(offsets, sizes)]

        def then(ok: list[bool]) -> None:
            if getattr(conn, "tenant", None) is tenant and _open(conn):
                pool.unlease(offsets, sizes, conn.id)
                lease = self._lease(pool, conn) if want_lease else (0, 0)
                self._reply(conn, m.Stored.wire(rid=rid, ok=ok, lease_offset=lease[0],
                                                lease_size=lease[1]))

        self._send(tenant, keys, views, self._deadline(budget_ms), then)

    def reserved(self, conn: Any, keys: Sequence[str], grants: Sequence[Any],
                 write_rcache: bool) -> None:
        """Remember the NEW reservations of a Reserve (for their Commit)."""
        mine = self._reserved.setdefault(conn.id, {})
        for k, g in zip(keys, grants):
            if g.status is GrantStatus.NEW:
                mine[g.token] = (k, g.offset, g.size, write_rcache)

    def commit(self, conn: Any, tenant: Any, rid: int, tokens: list[int],
               budget_ms: int) -> bool:
        """Handle a Commit: write-behind for ``write_rcache`` tokens, the home node only
        for the others. False when none of its tokens is known here (the daemon then
        commits as without a cluster)."""
        mine = self._reserved.get(conn.id, {})
        entries = [mine.pop(t, None) for t in tokens]
        if not any(entries):
            return False
        pool: Pool = tenant.pool
        through = [i for i, e in enumerate(entries) if e is not None and not e[3]]
        sends = [entries[i] for i in through]  # (key, offset, size, write_rcache)
        through_set = set(through)
        local = [i for i in range(len(tokens)) if i not in through_set]
        ok = [False] * len(tokens)
        for i, good in zip(local, pool.commit([tokens[i] for i in local], conn.id)):
            ok[i] = good
        behind = [e for i in local if ok[i] and (e := entries[i]) is not None]
        if behind:
            self.write_behind(tenant, [e[0] for e in behind], [e[2] for e in behind])
        if not through:
            self._reply(conn, m.Committed.wire(rid=rid, ok=ok))
            return True
        memory = self._memory(tenant)
        views = [memory[e[1]:e[1] + e[2]] for e in sends if e is not None]

        def then(sent: list[bool]) -> None:
            pool.abort([tokens[i] for i in through], conn.id)  # no local copy kept
            for i, good in zip(through, sent):
                ok[i] = good
            self._reply(conn, m.Committed.wire(rid=rid, ok=ok))

        self._send(tenant, [e[0] for e in sends if e is not None], views,
                   self._deadline(budget_ms), then)
        return True

    def forget(self, conn: Any, tokens: Sequence[int] = ()) -> None:
        """Tokens aborted (or, with none given, the whole connection gone)."""
        if not tokens:
            self._reserved.pop(conn.id, None)
            return
        mine = self._reserved.get(conn.id)
        if mine:
            for t in tokens:
                mine.pop(t, None)

    # ------------------------------------------------------------ report
    def statistics(self) -> TierStatistics:
        with self._lock:
            c = dict(self._c)
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

    def report(self) -> dict[str, Any]:
        st = self.statistics()
        row = dataclasses.asdict(st)
        lookups = st.hits + st.misses
        row["hit_rate"] = st.hits / lookups if lookups else 0.0
        nodes = self.client.slots.rows()
        return {"seeds": [f"{h}:{p}" for h, p in self.settings.seeds], "tls": self.settings.tls,
                "state": "down" if self.client.down_logged else "ok", "tier": row,
                "redirects": dict(self.client.redirects), "nodes": nodes}

    def close(self) -> None:
        """Stop the workers (their batches end by their deadlines), then the client."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self.drain()
        self.client.close()
        for mm, view in self._maps.values():
            view.release()
            try:
                mm.close()
            except BufferError:  # a view still exported (a bug elsewhere): leave it
                pass
        self._maps.clear()


class _Fetch:
    """One batch of GETs in flight; the requests that wait for it."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: list[_Waiting] = []


class _Waiting:
    """An Acquire waiting for ``pending`` fetches (then its leading run is pinned)."""

    __slots__ = ("conn", "tenant", "rid", "keys", "sizes", "pins", "pending")

    def __init__(self, conn: Any, tenant: Any, rid: int, keys: list[str], sizes: list[int],
                 pins: list, pending: int) -> None:
        self.conn, self.tenant, self.rid = conn, tenant, rid
        self.keys, self.sizes, self.pins, self.pending = keys, sizes, pins, pending


def _open(conn: Any) -> bool:
    return getattr(getattr(conn, "phase", None), "value", "") == "ready"


def start(config: Any, wake: Callable[[], None], reply: Callable[..., None],
          lease: Callable[[Pool, Any], tuple[int, int]]) -> ClusterTier:
    """The tier of a daemon's ``config`` (``cluster`` set); raises ``DaemonError``-worthy
    RuntimeError when it cannot run (the checksum package missing)."""
    from ems.cluster.topology import parse_url
    settings = parse_url(config.cluster, config.cluster_ca_file,
                         config.cluster_cert_file, config.cluster_key_file)
    if config.cluster_password:
        settings = dataclasses.replace(settings, password=config.cluster_password)
    tier = ClusterTier(settings, wake, reply, lease,
                       write_behind_bytes=config.cluster_write_behind_bytes,
                       reservation_ttl_s=config.reservation_ttl_s)
    logger.info("ems-server: cluster tier on %s (%s), write-behind bound %d MiB",
                ",".join(f"{h}:{p}" for h, p in settings.seeds),
                "TLS" if settings.tls else "plain TCP", config.cluster_write_behind_bytes >> 20)
    return tier
