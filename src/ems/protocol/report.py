"""The statistics report's typed rows: what a ``StatsReply`` says of one tenant's pool.

The daemon sends its report as plain data (``StatsReply.stats``: a tree of dicts,
lists and numbers, so ``ems stats --json`` prints it as it came); a client reads its
tenant's row with :func:`pool_statistics`, checked field by field. The fields are the
pool core's ``PoolStatistics`` (``ems.pool`` imports nothing of ours, so it keeps its
own definition; ``tests/unit/test_protocol_connection.py`` pins the two equal).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ems.errors import EmsErrorCode, EmsException

__all__ = ["PoolStatistics", "pool_statistics"]


@dataclasses.dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of one tenant's pool (``ContextCaching.statistics()``)."""

    capacity_bytes: int
    used_bytes: int
    objects: int
    reserved: int
    pinned: int
    hits: int
    misses: int
    evictions: int
    expired_reservations: int
    #: pool space held by connections' leases (part of ``used_bytes``)
    leased_bytes: int = 0
    #: bytes of the objects pinned by hits / made visible by commits and carves
    hit_bytes: int = 0
    stored_bytes: int = 0
    #: why lookups missed: no such key, a key of another size, a key still being written
    miss_absent: int = 0
    miss_size_mismatch: int = 0
    miss_pending: int = 0
    #: reservations refused: no room after evicting all it could / bigger than the pool
    refused_full: int = 0
    refused_too_large: int = 0
    #: the arena (the tenant's memory); ``capacity_bytes`` is the usage limit within it
    arena_bytes: int = 0
    #: connections holding a lease
    leases: int = 0
    #: where ``used_bytes`` goes: committed objects / reservations being written (each
    #: rounded up to the allocation unit); ``leased_bytes`` is the rest
    live_bytes: int = 0
    reserved_bytes: int = 0
    #: bytes the pool may still allocate before it must evict (``capacity_bytes`` minus
    #: ``used_bytes``; 0 while a lowered quota is exceeded)
    free_bytes: int = 0
    #: ``evictions`` split by cause: the policy's own victims (the pool needed the
    #: bytes) and neighbours of a victim evicted only because a larger object needed
    #: contiguous space (fragmentation); and the bytes evicted in all
    evictions_capacity: int = 0
    evictions_fragmentation: int = 0
    evicted_bytes: int = 0
    #: leases refused: no free extent of a lease's size and the LRU victim's place too
    #: small (a lease evicts at most that victim: the connection's saves reserve)
    leases_refused: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


_FIELDS = dataclasses.fields(PoolStatistics)


def pool_statistics(row: Any) -> PoolStatistics:
    """One tenant's row of a report as :class:`PoolStatistics` (other keys of the row,
    e.g. ``tiers``, are the report's own); a missing or non-integer counter is
    ``EMS_PROTOCOL_ERROR`` naming it."""
    if type(row) is not dict:
        raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                           f"a statistics row must be a map, got {type(row).__name__}")
    values = {}
    for f in _FIELDS:
        v = row.get(f.name, f.default)
        if type(v) is not int or v < 0:
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                               f"statistics field {f.name} must be an integer >= 0, "
                               f"got {v!r}")
        values[f.name] = v
    return PoolStatistics(**values)
