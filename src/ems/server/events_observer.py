"""KV events as an observer of the pools: what the host's shared memory stores and
evicts, published by ``ems.server.kv_events`` in vLLM's own format.

Not a place where bytes live: it handles no load, count or save (so it is an
``ems.server.tiers.Observer``, not a tier), and only watches the pools through the
observer's hooks (:meth:`Observer.stored`, :meth:`Observer.evicted`):

* a save's NEW keys that came with the engine's block hashes (``hashes`` of Reserve /
  Put) -> ``BlockStored`` (medium ``ems-shm``: CPU, LOCAL);
* an eviction from shared memory -> ``BlockRemoved`` of the hashes the publisher
  remembered for those keys.

Keys saved without hashes (V0 saves, engines that send none) publish nothing: a
router matches blocks by the engine's hashes, which ems cannot make up.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Sequence

from ems.server.kv_events import KvEventPublisher
from ems.server.tenants import Tenant
from ems.server.tiers import Observer, Report

__all__ = ["EventsObserver"]

SHM = "ems-shm"


class EventsObserver(Observer):
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

    def report(self) -> Optional[Report]:
        return dataclasses.asdict(self.publisher.statistics())
