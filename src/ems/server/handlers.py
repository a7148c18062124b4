"""The daemon's request handlers: a tenant session's requests against its pool and tiers.

``ems.server.daemon`` reads the sockets and drives each connection's protocol state;
a checked request of a READY tenant session comes here in its wire form (``[TYPE,
fields...]``, the fields positional in the order of the message's one definition) and
goes to one handler per message type, whose parameters are the message's fields by
name (a unit test pins them). The pool core is synchronous, so most requests are a few
dictionary operations answered at once.

Where a request can go beyond shared memory the handlers call the tiers
(``ems.server.tiers``), in order, and answer once they are done:

* **Acquire** (a load): the local pool's leading hits are pinned; for the rest each
  tier in turn (disk, then cluster; only the local tiers with ``read_local_only``)
  fills shared memory with the leading keys it has, and the handler pins those
  (:class:`_Load`)::

      pins = acquire(local) --miss--> tier 1 fill --done--> acquire --miss--> tier 2 ...
                   |                                  |                          |
                   +--all hit-------------------------+--all hit--> Pinned <-----+

* **Exists**: the same walk with counts instead of pins (:class:`_Count`).
* **Commit / Put** of new keys: the tiers that want it are told (:meth:`Tier.stored`:
  the disk writes them through, the cluster writes them behind); keys saved with
  ``write_rcache`` False go to the tier that takes saves through (the cluster) and
  are answered when it has them.

Every resource a client can make the daemon hold is bounded
(:class:`~ems.server.config.Limits`): keys per request and key length (refused), pins
per session (an Acquire pins what fits), lease space per session and per tenant (no
lease: small saves then take reserve/commit). Each refusal is counted in ``refused``.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Callable, Hashable, Optional, Protocol, Sequence, cast

from ems.errors import EmsErrorCode, EmsException
from ems.pool.core import Grant, GrantStatus, Pin, Pool
from ems.protocol import messages as m
from ems.server.config import Limits
from ems.server.session import Reservation, Session
from ems.server.tenants import Tenant
from ems.server.tiers import Extent, Observer, Tier

__all__ = ["BUDGET_SHARE", "Handlers", "Output", "lease_bytes"]


def lease_bytes(capacity_bytes: int) -> int:
    """Size of a connection's lease in a pool of ``capacity_bytes`` (the daemon's
    choice: it announces it in ``Welcome.lease_size``, and the client saves through
    the lease only what fits in it)."""
    return max(0, min(1 << 20, capacity_bytes // 64)) // 64 * 64


#: Share of a request's remaining time (``budget_ms``) given to the tiers' work; the
#: rest is for the reply and the client's copy.
BUDGET_SHARE = 0.8
_NEW, _FULL = GrantStatus.NEW, GrantStatus.FULL
#: the share of what is left of a save's deadline (a Reserve's ``budget_ms``) that it may
#: wait for a disk's writer: the rest is for the copy and the Commit
_WAIT_SHARE = 0.5
#: a named tuple (a Reservation per key of a save) made without its ``__new__``'s call:
#: see ``ems.pool.core._new``
_new = tuple.__new__

#: requests whose field of this name is a list of keys (or of tokens / ranges) to
#: bound, as its position (from the message's one definition)
_KEYS_AT: dict[type[m.Message], int] = {
    cls: cls._NAMES.index("keys") for cls in (m.Reserve, m.Acquire, m.Exists, m.Put)}
_LISTS_AT: dict[type[m.Message], int] = {
    cls: cls._NAMES.index(name) for cls, name in (
        (m.Commit, "tokens"), (m.Abort, "tokens"), (m.Release, "tokens"),
        (m.Return, "offsets"))}


class Output(Protocol):
    """How the handlers answer (the daemon's output side)."""

    def reply(self, session: Session, wire: list[object]) -> None:
        """Send a reply in its wire form; dropped when the session is not ready."""


class Handlers:
    """The tenant requests of every session (on the event loop)."""

    def __init__(self, limits: Limits, tiers: Sequence[Tier], output: Output,
                 refused: collections.Counter, observers: Sequence[Observer] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        #: monotonic seconds; the daemon's, or a test's ``ems.testing.clock.FakeClock``
        self._clock = clock
        self.tiers = list(tiers)
        self._local_tiers = [t for t in self.tiers if t.local]
        #: told of new objects: the observers first (KV events must know a key's hash
        #: before a tier's worker may have written it out and reports it), then the
        #: tiers that want it; of evictions: the tiers, then the observers
        self._stored_tiers: list[Tier | Observer] = list(observers)
        self._stored_tiers += [t for t in self.tiers if t.wants_stored]
        self._evicted_tiers: list[Tier | Observer] = [t for t in self.tiers if t.wants_evicted]
        self._evicted_tiers += observers
        #: the tiers a save may wait for (they write new objects out)
        self._waits = [t for t in self.tiers if t.wants_stored]
        self._through: Optional[Tier] = next(
            (t for t in self.tiers if t.takes_saves_through), None)
        #: sessions remember their reservations only where a Commit must know them
        self._track = bool(self._stored_tiers) or self._through is not None
        self._output = output
        self.refused = refused

    def serve(self, session: Session, cls: type[m.Message], v: list) -> bool:
        """Handle a tenant request; False when ``cls`` is not one (Ping, Stats)."""
        handler = _HANDLERS.get(cls)
        tenant = session.tenant
        if handler is None or tenant is None:
            return False
        at = _KEYS_AT.get(cls)
        if at is not None and not self._keys_within_limits(session, cls, v, at):
            return True
        at = _LISTS_AT.get(cls)
        if at is not None and len(v[at]) > self.limits.max_keys_per_request:
            self.refused["max_keys_per_request"] += 1
            raise EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT,
                               f"{cls.__name__} of {len(v[at])} entries exceeds "
                               f"max_keys_per_request ({self.limits.max_keys_per_request})")
        handler(self, session, tenant.pool, *v)
        return True

    def opened(self, tenant: Tenant) -> None:
        """A session of ``tenant`` is ready: its pool tells the tiers that want it of
        its evictions (set once; a pool evicts only for its tenant's requests)."""
        evicted = self._evicted_tiers
        if evicted and tenant.pool.on_evict is None:
            def on_evict(key: object, size: int) -> None:
                for tier in evicted:
                    tier.evicted(tenant, str(key), size)
            tenant.pool.on_evict = on_evict

    def closed(self, session: Session) -> None:
        """A session ended (its pool state is dropped already)."""
        session.reservations.clear()
        for tier in self.tiers:
            tier.closed(session)

    # ------------------------------------------------------------ helpers
    def _reply(self, session: Session, wire: list[object]) -> None:
        self._output.reply(session, wire)

    def _error(self, session: Session, rid: int, code: EmsErrorCode, message: str) -> None:
        """Refuse one request (the session stays)."""
        self._reply(session, m.Error.wire(rid=rid, code=code.value, message=message))

    def _keys_within_limits(self, session: Session, cls: type[m.Message], v: list,
                            at: int) -> bool:
        """Refuse (an error reply, False) a request over the key limits."""
        keys, limits = v[at], self.limits
        problem = None
        if len(keys) > limits.max_keys_per_request:
            problem = ("max_keys_per_request",
                       f"{cls.__name__} of {len(keys)} keys exceeds max_keys_per_request "
                       f"({limits.max_keys_per_request}); split the batch")
        elif keys and max(map(len, keys)) * 4 > limits.max_key_bytes:  # (chars * 4 >= bytes)
            for i, key in enumerate(keys):
                n = len(key.encode())
                if n > limits.max_key_bytes:
                    problem = ("max_key_bytes",
                               f"{cls.__name__}: key {i} is {n} bytes, more than "
                               f"max_key_bytes ({limits.max_key_bytes})")
                    break
        if problem is None:
            return True
        self.refused[problem[0]] += 1
        self._error(session, v[0], EmsErrorCode.EMS_INVALID_ARGUMENT, problem[1])
        return False

    def _deadline(self, budget_ms: int, share: float = BUDGET_SHARE) -> Optional[float]:
        """The tiers' deadline of a request with ``budget_ms`` left (0: none given):
        ``share`` of it from now."""
        return self._clock() + budget_ms / 1000 * share if budget_ms else None

    def _lease(self, pool: Pool, session: Session) -> tuple[int, int]:
        """A fresh lease for ``session``: (offset, size), or (0, 0) when there is no
        room or a lease limit says no (the client then saves through reserve/commit)."""
        size = lease_bytes(pool.capacity_bytes)
        if not size:
            return 0, 0
        limits = self.limits
        if pool.leased_by(session.id) + size > limits.max_leases_per_connection * size:
            self.refused["max_leases_per_connection"] += 1
            return 0, 0
        if pool.leased_bytes + size > limits.lease_share * pool.capacity_bytes:
            self.refused["lease_share"] += 1
            return 0, 0
        offset = pool.lease(size, session.id, spare_unwritten=bool(self._waits))
        return (0, 0) if offset is None else (offset, size)

    def _stored(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int],
                hashes: Optional[Sequence[Optional[int]]] = None, write_out: bool = True
                ) -> None:
        for tier in self._stored_tiers:
            if isinstance(tier, Tier):  # (an observer watches shared memory only)
                tier.stored(tenant, keys, sizes, hashes, write_out=write_out)
            else:
                tier.stored(tenant, keys, sizes, hashes)

    def _stored_here(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """Objects another host's save brought into shared memory (a cluster fill): the
        local tiers keep them too, so a restart of this host still finds them here."""
        for tier in self._local_tiers:
            if tier.wants_stored:
                tier.stored(tenant, keys, sizes)

    # ------------------------------------------------------------ handlers
    # One per request type; after (session, pool), the message's fields by name, in the
    # order of their one definition in ``ems.protocol.messages``.
    def _on_reserve(self, session: Session, pool: Pool, rid: int, keys: list[str],
                    sizes: list[int], write_rcache: bool, hashes: Optional[list[int]],
                    write_out: bool = True, budget_ms: int = 0) -> None:
        if sizes and min(sizes) <= 0:
            self._error(session, rid, EmsErrorCode.EMS_INVALID_ARGUMENT, "sizes must be > 0")
            return
        waits = self._waits
        grants = pool.reserve(keys, sizes, session.id, spare_unwritten=bool(waits))
        if waits and any(g.status is _FULL for g in grants):
            self._reserve_later(session, pool, rid, keys, sizes, grants, self._clock(),
                                self._deadline(budget_ms, _WAIT_SHARE), write_rcache,
                                hashes, write_out)
            return
        self._granted(session, rid, keys, grants, write_rcache, hashes, write_out)

    def _reserve_later(self, session: Session, pool: Pool, rid: int, keys: list[str],
                       sizes: list[int], grants: list[Grant], since: float,
                       until: Optional[float], write_rcache: bool,
                       hashes: Optional[list[int]], write_out: bool) -> None:
        """Back-pressure: some keys of a Reserve found the pool full of objects a tier
        has not written out yet. Wait for one of its writes to end (then they are
        evictable without loss) and ask again for those keys, until the tier's
        ``save_wait_s`` or ``until`` (half of what was left of the save's deadline,
        ``_WAIT_SHARE``: the copy and the Commit need the rest), whichever first; then
        once more, evicting unwritten objects if it must (counted by the tier as
        ``evicted_unwritten``). A save past its deadline has been given up by its
        client, which aborts what it is granted: bounded by half of it, the wait ends
        while the client still waits for the answer, rather than evicting for a save
        the client has given up."""
        tenant = session.tenant
        assert tenant is not None

        def regrant(spare: bool) -> None:  # ask again for the keys still FULL
            full = [i for i, g in enumerate(grants) if g.status is _FULL]
            for i, g in zip(full, pool.reserve([keys[i] for i in full],
                                               [sizes[i] for i in full], session.id,
                                               spare_unwritten=spare)):
                grants[i] = g

        def again() -> None:
            if not session.serves(tenant):
                return  # gone: its reservations went with it (``drop_owner``)
            regrant(True)
            self._reserve_later(session, pool, rid, keys, sizes, grants, since, until,
                                write_rcache, hashes, write_out)

        if any(g.status is _FULL for g in grants):
            if any(t.wait_written(tenant, since, until, again) for t in self._waits):
                return
            regrant(False)  # waited long enough, or nothing to wait for
        self._granted(session, rid, keys, grants, write_rcache, hashes, write_out)

    def _granted(self, session: Session, rid: int, keys: list[str], grants: list[Grant],
                 write_rcache: bool, hashes: Optional[list[int]], write_out: bool) -> None:
        # Only a save that is not of the defaults is remembered per key: a Commit takes
        # the others' keys and sizes from the pool (a 16 KiB spill through a disk tier:
        # a named tuple, a table entry and its removal per value, on the loop).
        if self._track and (hashes is not None or not write_rcache or not write_out):
            mine = session.reservations
            for key, g, h in zip(keys, grants, itertools.repeat(None) if hashes is None
                                 else hashes):
                if g.status is _NEW:  # (all fields: ``_new`` takes no defaults)
                    mine[g.token] = _new(Reservation, (key, g.offset, g.size, write_rcache,
                                                       h, write_out))
        # (the columns as tuples: msgpack packs them, and GrantStatus, as it would lists
        # and ints; 1,024 grants, ~135 -> ~97 ns a key)
        statuses, tokens, offsets, sizes = zip(*grants) if grants else ((), (), (), ())
        self._reply(session, m.Granted.wire(rid=rid, statuses=statuses, tokens=tokens,
                                            offsets=offsets, sizes=sizes))

    def _on_commit(self, session: Session, pool: Pool, rid: int, tokens: list[int],
                   budget_ms: int) -> None:
        if not self._track:
            self._reply(session, m.Committed.wire(rid=rid, ok=pool.commit(tokens, session.id)))
            return
        mine = session.reservations
        got: list[Hashable] = []  # (the daemon's pool keys are str)
        got_sizes: list[int] = []
        if not mine:  # saves of the defaults only: the keys and sizes from the pool
            ok = pool.commit(tokens, session.id, stored=(got, got_sizes))
            if got:
                self._stored(session.tenant, cast(list[str], got),  # type: ignore[arg-type]
                             got_sizes)
            self._reply(session, m.Committed.wire(rid=rid, ok=ok))
            return
        entries = [mine.pop(t, None) for t in tokens]
        through = [i for i, e in enumerate(entries)
                   if e is not None and not e.write_rcache] if self._through else []
        local: Sequence[int] = range(len(tokens))
        ok = [False] * len(tokens)
        if through:
            sent = set(through)
            local = [i for i in local if i not in sent]
        for i, good in zip(local, pool.commit([tokens[i] for i in local], session.id,
                                              stored=(got, got_sizes))):
            ok[i] = good
        done = iter(zip(cast(list[str], got), got_sizes))
        new = []
        for i in local:
            if ok[i]:  # (a key saved with the defaults was not remembered: the pool's)
                key, size = next(done)
                e = entries[i]
                new.append(e if e is not None else
                           _new(Reservation, (key, 0, size, True, None, True)))
        if new:
            keys, _, sizes, _, hashes, outs = zip(*new)
            if len(set(outs)) == 1:  # (one save has one write_out: one call)
                self._stored(session.tenant, keys, sizes, hashes,  # type: ignore[arg-type]
                             outs[0])
            else:  # saves of both kinds committed together
                for out in (True, False):
                    part = [e for e in new if e.write_out is out]
                    self._stored(session.tenant,  # type: ignore[arg-type]
                                 [e.key for e in part], [e.size for e in part],
                                 [e.hash for e in part], out)
        if not through:
            self._reply(session, m.Committed.wire(rid=rid, ok=ok))
            return
        sends = [entries[i] for i in through]

        def then(sent: list[bool]) -> None:
            pool.abort([tokens[i] for i in through], session.id)  # no local copy kept
            for i, good in zip(through, sent):
                ok[i] = good
            self._reply(session, m.Committed.wire(rid=rid, ok=ok))

        assert self._through is not None and session.tenant is not None
        self._through.save_through(session.tenant, [e.key for e in sends if e is not None],
                                   [Extent(e.offset, e.size) for e in sends if e is not None],
                                   self._deadline(budget_ms), then,
                                   [e.hash for e in sends if e is not None])

    def _on_abort(self, session: Session, pool: Pool, tokens: list[int]) -> None:
        pool.abort(tokens, session.id)
        if session.reservations:
            for t in tokens:
                session.reservations.pop(t, None)

    def _on_put(self, session: Session, pool: Pool, rid: int, keys: list[str],
                offsets: list[int], sizes: list[int], want_lease: bool, write_rcache: bool,
                budget_ms: int, hashes: Optional[list[int]], write_out: bool = True
                ) -> None:
        tenant = session.tenant
        assert tenant is not None
        through = self._through
        if through is not None and not write_rcache:  # that tier only
            if not pool.owns(offsets, sizes, session.id):
                raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                                   "Put: a range that is not a free range of this "
                                   "connection's lease")

            def then(ok: list[bool]) -> None:
                if session.serves(tenant):
                    pool.unlease(offsets, sizes, session.id)
                    offset, size = self._lease(pool, session) if want_lease else (0, 0)
                    self._reply(session, m.Stored.wire(rid=rid, ok=ok, lease_offset=offset,
                                                       lease_size=size))

            through.save_through(tenant, keys, [Extent(o, s) for o, s in zip(offsets, sizes)],
                                 self._deadline(budget_ms), then, hashes)
            return
        try:
            statuses = pool.carve(keys, offsets, sizes, session.id)
        except ValueError as exc:  # only its own lease: anything else ends the connection
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR, f"Put: {exc}") from None
        offset, size = self._lease(pool, session) if want_lease else (0, 0)
        # NEW, EXISTS (write-once) and BUSY (another writer's) all count as stored.
        self._reply(session, m.Stored.wire(rid=rid, ok=[True] * len(keys), lease_offset=offset,
                                           lease_size=size))
        if self._stored_tiers:  # after the reply: the tiers' writes are not its business
            new = [i for i, st in enumerate(statuses) if st is _NEW]
            if new:
                self._stored(tenant, [keys[i] for i in new], [sizes[i] for i in new],
                             None if hashes is None else [hashes[i] for i in new], write_out)

    def _on_return(self, session: Session, pool: Pool, offsets: list[int], sizes: list[int]
                   ) -> None:
        pool.unlease(offsets, sizes, session.id)

    def _on_lease(self, session: Session, pool: Pool, rid: int) -> None:
        offset, size = self._lease(pool, session)
        self._reply(session, m.Leased.wire(rid=rid, offset=offset, size=size))

    def _on_acquire(self, session: Session, pool: Pool, rid: int, keys: list[str],
                    sizes: Optional[list[int]], local_only: bool, budget_ms: int) -> None:
        room = self.limits.max_pins_per_connection - session.pins
        if room < len(keys):  # pin what fits: the keys after it miss
            self.refused["max_pins_per_connection"] += 1
            keys = keys[:max(room, 0)]
            sizes = None if sizes is None else sizes[:len(keys)]
        pins = pool.acquire(keys, sizes, session.id)
        session.pins += len(pins)
        if len(pins) < len(keys):
            tiers = self._local_tiers if local_only else self.tiers
            if tiers:
                assert session.tenant is not None
                _Load(self, session, session.tenant, rid, keys, sizes, pins, tiers,
                      self._deadline(budget_ms)).next()
                return
        self._answer_pins(session, rid, pins)

    def _answer_pins(self, session: Session, rid: int, pins: Sequence[Pin]) -> None:
        self._reply(session, m.Pinned.wire(rid=rid, tokens=[p.token for p in pins],
                                           offsets=[p.offset for p in pins],
                                           sizes=[p.size for p in pins]))

    def _on_release(self, session: Session, pool: Pool, tokens: list[int]) -> None:
        session.pins -= pool.release(tokens, session.id)

    def _on_exists(self, session: Session, pool: Pool, rid: int, keys: list[str],
                   sizes: Optional[list[int]], local_only: bool, budget_ms: int) -> None:
        n = pool.exists(keys, sizes)
        if n < len(keys):
            tiers = self._local_tiers if local_only else self.tiers
            if tiers:
                assert session.tenant is not None
                _Count(self, session, session.tenant, rid, keys, sizes, n, tiers,
                       self._deadline(budget_ms)).next()
                return
        self._reply(session, m.Count.wire(rid=rid, n=n))


class _Load:
    """An Acquire walking the tiers for the keys after its pins (module docstring).

    While the tiers fill its misses, the load holds (``Pool.hold``) the keys after the
    first miss that are in shared memory already: the fill's reservations evict LRU
    objects, and without the hold those could be the request's own later blocks, so
    a load right after an exists found fewer blocks than the exists counted (1-2
    requests of a disk-tier trace replay did). A tier fills the run of misses up to
    the first key that is here; when that made progress the same tier is asked
    again for the keys after it (each round pins at least one more key), so a chain
    of disk-only and resident runs loads whole, as the exists counted it (4 requests
    of 3,000 in a disk-tier replay of the Mooncake trace did not). A tier whose own
    run ended the pins is not asked again: it lacks the next key."""

    __slots__ = ("handlers", "session", "tenant", "rid", "keys", "sizes", "pins", "tiers",
                 "deadline", "_next", "_held")

    def __init__(self, handlers: Handlers, session: Session, tenant: Tenant, rid: int,
                 keys: list[str], sizes: Optional[list[int]], pins: list[Pin],
                 tiers: list[Tier], deadline: Optional[float]) -> None:
        self.handlers, self.session, self.tenant, self.rid = handlers, session, tenant, rid
        self.keys, self.sizes, self.pins, self.tiers = keys, sizes, pins, tiers
        self.deadline = deadline
        self._next = 0
        #: the later keys that were here before any fill, held under one token
        self._held = tenant.pool.hold(keys[len(pins) + 1:], session.id)

    def _answer(self) -> None:
        if self.session.serves(self.tenant):  # (a hold released already, or none: 0)
            self.tenant.pool.release_held(self._held.token, self.session.id)
        self.handlers._answer_pins(self.session, self.rid, self.pins)

    def next(self) -> None:
        """Ask the next tier for the keys still missing; answer when none is left."""
        while self._next < len(self.tiers):
            tier = self.tiers[self._next]
            self._next += 1
            n = len(self.pins)
            sizes = None if self.sizes is None else self.sizes[n:]
            if tier.fill(self.tenant, self.keys[n:], sizes, self.deadline, self._filled):
                return
        self._answer()

    def _filled(self) -> None:
        session, n = self.session, len(self.pins)
        if session.serves(self.tenant):  # pin what the tier brought, then go on
            sizes = None if self.sizes is None else self.sizes[n:]
            more = self.tenant.pool.acquire(self.keys[n:], sizes, session.id, count=False)
            session.pins += len(more)
            self.pins.extend(more)
            filler = self.tiers[self._next - 1]
            if more and not filler.local:  # a copy on this host's own tiers (the disk)
                self.handlers._stored_here(self.tenant, self.keys[n:n + len(more)],
                                           [p.size for p in more])
            if len(self.pins) < len(self.keys):
                if more and self.keys[len(self.pins) - 1] in self._held.keys:
                    self._next -= 1  # the same tier again, for the keys after a run here
                self.next()
                return
        self._answer()


class _Count:
    """An Exists walking the tiers for the keys after its local count."""

    __slots__ = ("handlers", "session", "tenant", "rid", "keys", "sizes", "n", "tiers",
                 "deadline", "_next")

    def __init__(self, handlers: Handlers, session: Session, tenant: Tenant, rid: int,
                 keys: list[str], sizes: Optional[list[int]], n: int, tiers: list[Tier],
                 deadline: Optional[float]) -> None:
        self.handlers, self.session, self.tenant, self.rid = handlers, session, tenant, rid
        self.keys, self.sizes, self.n, self.tiers = keys, sizes, n, tiers
        self.deadline = deadline
        self._next = 0

    def next(self) -> None:
        while self._next < len(self.tiers) and self.n < len(self.keys):
            tier = self.tiers[self._next]
            self._next += 1
            sizes = None if self.sizes is None else self.sizes[self.n:]
            if tier.count(self.tenant, self.keys[self.n:], sizes, self.deadline,
                          self._counted):
                return
        self.handlers._reply(self.session, m.Count.wire(rid=self.rid, n=self.n))

    def _counted(self, n: int) -> None:
        self.n += n
        self.next()


#: The request handlers of a tenant session, by message class.
_HANDLERS: dict[type[m.Message], Callable[..., None]] = {
    m.Reserve: Handlers._on_reserve,
    m.Commit: Handlers._on_commit,
    m.Abort: Handlers._on_abort,
    m.Put: Handlers._on_put,
    m.Return: Handlers._on_return,
    m.Lease: Handlers._on_lease,
    m.Acquire: Handlers._on_acquire,
    m.Release: Handlers._on_release,
    m.Exists: Handlers._on_exists,
}
