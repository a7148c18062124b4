"""The statistics report's typed rows: what a ``StatsReply`` says of one tenant's pool.

The daemon sends its report as plain data (``StatsReply.stats``: a tree of dicts,
lists and numbers, so ``ems stats --json`` prints it as it came); a client reads its
tenant's row with :func:`pool_statistics`, checked field by field. The fields are the
pool core's ``PoolStatistics`` (``ems.pool`` imports nothing of ours, so it keeps its
own definition; ``tests/unit/test_protocol_connection.py`` pins the two equal).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar, Union

from ems.errors import EmsErrorCode, EmsException

__all__ = ["DaemonReport", "PoolStatistics", "ServerRow", "TenantRow", "Wire",
           "WireRow", "pool_statistics"]

#: what crosses the wire: msgpack's tree of maps, lists and scalars
Wire = Union[None, bool, int, float, str, list["Wire"], dict[str, "Wire"]]


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


R = TypeVar("R", bound="WireRow")


def _to_wire(v: object) -> Wire:
    if isinstance(v, WireRow):
        return v.to_wire()
    if isinstance(v, dict):
        return {str(k): _to_wire(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_wire(x) for x in v]
    assert v is None or isinstance(v, (bool, int, float, str)), v
    return v


class WireRow:
    """A frozen dataclass row whose wire form (a map, one key per field, the field's
    name) is generated from its fields: a new counter is a new field with a default,
    and both ends know it. ``from_wire`` takes a row without the newer fields (an
    older daemon's) at their defaults and ignores keys it does not know (a newer
    daemon's); a field of the wrong type is ``EMS_PROTOCOL_ERROR`` naming it."""

    def to_wire(self) -> dict[str, Wire]:
        return {f.name: _to_wire(getattr(self, f.name))
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls: type[R], row: Wire) -> R:
        if type(row) is not dict:
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                               f"a {cls.__name__} must be a map, got {type(row).__name__}")
        hints = typing.get_type_hints(cls)
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in row:
                values[f.name] = _from_wire(hints[f.name], row[f.name],
                                            f"{cls.__name__}.{f.name}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                               f"{cls.__name__}: {exc}") from exc


def _from_wire(kind: Any, v: Wire, where: str) -> object:
    origin = typing.get_origin(kind)
    if isinstance(kind, type) and issubclass(kind, WireRow):
        return kind.from_wire(v)
    if origin is dict:
        _, value_kind = typing.get_args(kind)
        if type(v) is not dict:
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR, f"{where} must be a map")
        return {k: _from_wire(value_kind, x, f"{where}[{k}]") for k, x in v.items()}
    ok = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}.get(kind)
    if ok is not None and (type(v) not in ok or (kind is not bool and type(v) is bool)):
        raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                           f"{where} must be {kind.__name__}, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class ServerRow(WireRow):
    """The daemon itself (``report["server"]``)."""

    pid: int = 0
    version: str = ""
    protocol: int = 0
    socket: str = ""
    uptime_s: float = 0.0
    connections: int = 0
    capacity_bytes: int = 0
    anonymous: bool = False
    #: named tenants
    tenants: int = 0
    reservation_ttl_s: float = 0.0
    spin_us: int = 0
    limits: dict[str, Wire] = dataclasses.field(default_factory=dict)
    #: requests and connections refused, by limit
    refused: dict[str, int] = dataclasses.field(default_factory=dict)
    buffered_bytes: int = 0
    accepting: bool = True


@dataclasses.dataclass(frozen=True)
class TenantRow(PoolStatistics, WireRow):
    """One tenant's pool, its connections and its rows in each tier (by tier name).
    ``hit_rate`` is :attr:`PoolStatistics.hit_rate`, the one definition, sent on the
    wire for readers of the dict."""

    connections: int = 0
    quota_bytes: int = 0
    source: str = ""
    tiers: dict[str, Wire] = dataclasses.field(default_factory=dict)

    def to_wire(self) -> dict[str, Wire]:
        out = WireRow.to_wire(self)
        out["hit_rate"] = self.hit_rate
        if not self.tiers:
            del out["tiers"]  # as before: the key only when a tier has a row
        return out


@dataclasses.dataclass(frozen=True)
class DaemonReport(WireRow):
    """``Daemon.statistics()``: the server row, a row per tenant the caller may see,
    and each tier's or observer's own report under its name (``parts``, flattened
    into the wire map beside ``server`` and ``tenants`` as before)."""

    server: ServerRow = dataclasses.field(default_factory=ServerRow)
    tenants: dict[str, TenantRow] = dataclasses.field(default_factory=dict)
    parts: dict[str, Wire] = dataclasses.field(default_factory=dict)

    def to_wire(self) -> dict[str, Wire]:
        out: dict[str, Wire] = {"server": self.server.to_wire(),
                                "tenants": {k: t.to_wire() for k, t in self.tenants.items()}}
        out.update(self.parts)
        return out

    @classmethod
    def from_wire(cls, row: Wire) -> DaemonReport:
        if type(row) is not dict:
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                               f"a DaemonReport must be a map, got {type(row).__name__}")
        tenants = row.get("tenants", {})
        if type(tenants) is not dict:
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                               "DaemonReport.tenants must be a map")
        return cls(server=ServerRow.from_wire(row.get("server", {})),
                   tenants={k: TenantRow.from_wire(t) for k, t in tenants.items()},
                   parts={k: v for k, v in row.items() if k not in ("server", "tenants")})
