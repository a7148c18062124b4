"""KV events as an observer of the pools: what the host's shared memory stores and
evicts, published by ``ems.server.kv_events`` in vLLM's own format.

Not a place where bytes live: it handles no load, count or save (so it is an
``ems.server.tiers.Observer``, not a tier), and only watches the pools through the
observer's hooks (:meth:`Observer.stored`, :meth:`Observer.evicted`):

* a save's NEW keys that came with the engine's block hashes (``hashes`` of Reserve /
  Put) -> ``BlockStored`` (medium ``ems-shm``: CPU, LOCAL);
* an eviction from shared memory -> ``BlockRemoved`` of the hashes the publisher
  remembered for those keys;
* the disk tier's record of such a key written -> ``BlockStored`` (medium ``ems-disk``:
  STORAGE, LOCAL), its removal from the disk (region evicted, record damaged) ->
  ``BlockRemoved`` (``ems-disk``): the tiers beyond shared memory report to
  :meth:`EventsObserver.tier_stored` / :meth:`EventsObserver.tier_removed`
  (``ems.server.tiers.TierEvents``). The disk tier writes from shared memory, so a
  key's hash is the one its save brought; the publisher's one ``key -> hash`` map
  serves every tier and forgets a key when no tier holds it any more.

Keys saved without hashes (V0 saves, engines that send none) publish nothing: a
router matches blocks by the engine's hashes, which ems cannot make up.
"""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence

from ems.protocol.report import EventsReport
from ems.server.kv_events import KvEventPublisher
from ems.server.tenants import Tenant
from ems.server.tiers import Observer, TierEvents

__all__ = ["EventsObserver"]

SHM = "ems-shm"


class EventsObserver(Observer, TierEvents):
    """See the module docstring (hooks on the event loop; the publisher never blocks:
    it queues for its own thread)."""

    name: ClassVar[str] = "kv_events"

    def __init__(self, publisher: KvEventPublisher) -> None:
        self.publisher = publisher

    def stored(self, tenant: Tenant, keys: Sequence[str], sizes: Sequence[int],
               hashes: Optional[Sequence[Optional[int]]] = None) -> None:
        if not hashes:
            return
        pairs = [(k, h) for k, h in zip(keys, hashes) if h is not None]
        if pairs:
            self.publisher.stored(tenant.name, [h for _, h in pairs], SHM,
                                  keys=[k for k, _ in pairs])

    def evicted(self, tenant: Tenant, key: str, size: int) -> None:
        self.publisher.evicted(tenant.name, [key], SHM)

    def tier_stored(self, tenant: str, keys: Sequence[str], tier: str,
                    hashes: Optional[Sequence[Optional[int]]] = None) -> None:
        if hashes is None:
            self.publisher.copied(tenant, keys, tier)
            return
        known = [(k, h) for k, h in zip(keys, hashes) if h is not None]
        if known:
            self.publisher.stored(tenant, [h for _, h in known], tier,
                                  keys=[k for k, _ in known])
        rest = [k for k, h in zip(keys, hashes) if h is None]
        if rest:
            self.publisher.copied(tenant, rest, tier)

    def tier_removed(self, tenant: str, keys: Sequence[str], tier: str, *,
                     any_writer: bool = False) -> None:
        self.publisher.evicted(tenant, keys, tier, count_untracked=not any_writer)

    def held(self, tier: str) -> dict[str, list[tuple[str, int]]]:
        return self.publisher.tracked(tier)

    def report(self) -> EventsReport:
        return self.publisher.statistics()
