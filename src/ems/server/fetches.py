"""Fetches into shared memory: which keys a tier is bringing in now, and who waits.

A tier that fills shared memory on a load's misses (the disk, the cluster) reserves
pool space for each key it will bring, under an owner of its own, writes the bytes
there from its workers, then commits what arrived whole and aborts the rest. Two
requests of one host often want the same keys at the same moment (the TP ranks of an
MLA model load the same blocks): the second one waits for the first one's fetch
instead of fetching them again. The bookkeeping of that, shared by the tiers::

    plan(keys):  key in flight?  -> wait for that fetch
                 else reserve    -> NEW: this request's fetch; else the run ends
    start(fetch) -> the tier's workers move the bytes
    finish(ok)   -> commit the good ones, abort the others, wake every waiter
                    whose last fetch this was

It runs on the event loop only (no lock).
"""

from __future__ import annotations

from typing import Callable, Hashable, NamedTuple, Optional, Sequence

from ems.pool.core import Grant, GrantStatus
from ems.server.tenants import Tenant

__all__ = ["Fetch", "FetchBook", "Reserved"]

_NEW = GrantStatus.NEW


class Reserved(NamedTuple):
    """A key reserved in a pool to fetch it into (made through ``tuple.__new__``: one
    per key a load fetches)."""

    key: str
    grant: Grant


#: a named tuple made from a tuple of all its fields, without its ``__new__``'s call
_new = tuple.__new__


class Fetch:
    """One batch of keys being brought in, and the requests that wait for it."""

    __slots__ = ("reserved", "tenant", "waiters")

    def __init__(self, tenant: Tenant, reserved: list[Reserved]) -> None:
        self.tenant, self.reserved = tenant, reserved
        self.waiters: list[_Waiting] = []


class _Waiting:
    """A request waiting for ``pending`` fetches; then its ``done`` runs."""

    __slots__ = ("done", "pending")

    def __init__(self, done: Callable[[], None], pending: int) -> None:
        self.done, self.pending = done, pending


class FetchBook:
    """The fetches of one tier (its pool owner is ``owner``)."""

    def __init__(self, owner: Hashable) -> None:
        self.owner = owner
        self._inflight: dict[tuple[int, str], Fetch] = {}

    def plan(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int],
             done: Callable[[], None], start: Callable[[Fetch], None]) -> bool:
        """Wait for fetches in flight or reserve (in order, up to the first key that is
        neither), ``start`` this request's own fetch, and run ``done`` once every fetch
        it waits for is finished. False: nothing to fetch or wait for."""
        pool, owner, inflight = tenant.pool, self.owner, self._inflight
        tid = tenant.segment_id
        waits: list[Fetch] = []
        mine: list[Reserved] = []
        i, n = 0, len(keys)
        while i < n:
            fetch = inflight.get((tid, keys[i]))
            if fetch is not None:
                if fetch not in waits:
                    waits.append(fetch)
                i += 1
                continue
            # the keys up to the next one in flight, reserved in one call (a call per
            # key, and a frozen dataclass per key: plan + finish of 1,024 keys of 16
            # KiB on a full pool took 8.8-10.5 us a key on the 2-vCPU VM, now 6.0-6.4)
            j = i + 1
            while j < n and (tid, keys[j]) not in inflight:
                j += 1
            run = keys[i:j]
            grants = pool.reserve(run, sizes[i:j], owner, leading=True)
            got = [_new(Reserved, pair) for pair in zip(run, grants)
                   if pair[1].status is _NEW]
            mine += got
            if len(got) < len(run):
                break  # a key neither in flight nor reservable: the run ends there
            i = j
        own: Optional[Fetch] = None
        if mine:
            own = Fetch(tenant, mine)
            for r in mine:
                self._inflight[(tid, r.key)] = own
            waits.append(own)
        if not waits:
            return False
        waiting = _Waiting(done, len(waits))
        for fetch in waits:
            fetch.waiters.append(waiting)
        if own is not None:
            start(own)
        return True

    def finish(self, fetch: Fetch, ok: Sequence[bool], late: Sequence[int] = ()) -> None:
        """``fetch`` is over: ``ok[i]`` says whether its i-th key's bytes are whole.

        ``late``: keys whose transfer is still running at the deadline. Their space
        stays reserved (bytes may still land in it) until :meth:`abort_late` once the
        transfer returned; the requests waiting are answered now, without them."""
        pool, tid = fetch.tenant.pool, fetch.tenant.segment_id
        ok = list(ok) + [False] * (len(fetch.reserved) - len(ok))
        running = set(late)
        pool.commit([r.grant.token for r, good in zip(fetch.reserved, ok) if good], self.owner)
        pool.abort([r.grant.token for i, (r, good) in enumerate(zip(fetch.reserved, ok))
                    if not good and i not in running], self.owner)
        for r in fetch.reserved:
            self._inflight.pop((tid, r.key), None)
        for waiting in fetch.waiters:
            waiting.pending -= 1
            if waiting.pending == 0:
                waiting.done()

    def abort_late(self, fetch: Fetch, indexes: Sequence[int]) -> None:
        """The transfers of keys that :meth:`finish` left running have returned: free
        their space (their bytes were never shown to anyone)."""
        fetch.tenant.pool.abort([fetch.reserved[i].grant.token for i in indexes], self.owner)
