"""KV events as an observer on the tier seam: what the host's shared memory stores and
evicts, published by ``ems.server.kv_events`` in vLLM's own format.

Not a place where bytes live: it handles no load, count or save, and only watches the
pools through the seam's hooks (:meth:`Tier.stored`, :meth:`Tier.evicted`):

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
from ems.server.tiers import Report, Tier

__all__ = ["EventsTier"]

SHM = "ems-shm"


class EventsTier(Tier):
    """See the module docstring (hooks on the event loop; the publisher never blocks:
    it queues for its own thread)."""

    name: ClassVar[str] = "kv_events"
    wants_stored: ClassVar[bool] = True
    wants_evicted: ClassVar[bool] = True

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
