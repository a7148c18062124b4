"""The daemon's statistics report as typed rows: what a ``StatsReply`` says.

The daemon builds a :class:`DaemonReport` (``Daemon.statistics()``) and sends its wire
form (``StatsReply.stats``: a tree of maps, lists and numbers, so ``ems stats --json``
prints it as it came); every reader (the Prometheus exporter, ``ems stats``, the
control plane's reporter and service, the leak checks) reads the rows' attributes,
parsing a wire map with :meth:`WireRow.from_wire`. Nothing outside this module reads
the report by string key::

    DaemonReport
      server     ServerRow
      tenants    {name: TenantRow}         a tenant's pool (PoolStatistics) and
                   tiers  TenantTiers        its rows in each tier: disk DiskTenantRow,
                                             cluster TierRow (local: to the control plane)
      disk       DiskReport                the disk tier (tier: TierTotals)
      cluster    ClusterReport             the cluster tier (tier: ClusterTierRow, nodes)
      kv_events  EventsReport              the KV event publisher
      others     {name: wire}              parts this version has no row for

A part is absent (None) when the daemon runs without it; the wire map then lacks its
key, as before. ``hit_rate`` has one definition, :func:`hit_rate`, and every row of
lookups sends it on the wire for readers of the dict.

A client reads its tenant's row with :func:`pool_statistics`, checked field by field.
The fields are the pool core's ``PoolStatistics`` (``ems.pool`` imports nothing of
ours, so it keeps its own definition; ``tests/unit/test_protocol_connection.py`` pins
the two equal). Likewise :class:`DiskReport` repeats the disk store's
``DiskStatistics`` (``ems.disk`` imports only ``errors``; pinned by
``tests/unit/test_report_wire.py``).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping, Optional, TypeVar, Union

from ems.errors import EmsErrorCode, EmsException

__all__ = ["ClusterNodeRow", "ClusterReport", "ClusterTierRow", "DaemonReport",
           "DiskReport", "DiskTenantRow", "EventsReport", "LocalTierRow", "PoolStatistics",
           "ServerRow", "TenantRow", "TenantTiers", "TierRow", "TierTotals", "Wire", "WireRow",
           "hit_rate", "only_tenant", "pool_statistics"]

#: what crosses the wire: msgpack's tree of maps, lists and scalars
Wire = Union[None, bool, int, float, str, list["Wire"], dict[str, "Wire"]]


def hit_rate(hits: int, misses: int) -> float:
    """The share of lookups that hit, 0.0 before the first: the one definition (every
    row's ``hit_rate``, the tier driver's, and ``ems stats`` for sums of rows)."""
    lookups = hits + misses
    return hits / lookups if lookups else 0.0


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
        return hit_rate(self.hits, self.misses)


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


def only_tenant(report: Wire) -> PoolStatistics:
    """The one tenant's row of a tenant session's report (it sees only itself), checked
    as :func:`pool_statistics`; another number of rows is ``EMS_PROTOCOL_ERROR``."""
    tenants = report.get("tenants") if type(report) is dict else None
    rows = list(tenants.values()) if type(tenants) is dict else []
    if len(rows) != 1:
        raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR,
                           f"ems-server sent statistics of {len(rows)} tenants, expected 1")
    return pool_statistics(rows[0])


R = TypeVar("R", bound="WireRow")


def _part(parts: Mapping[str, WireRow], name: str, kind: type[R]) -> Optional[R]:
    """``parts[name]`` when it is a ``kind`` row, else None."""
    row = parts.get(name)
    return row if isinstance(row, kind) else None


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
    if origin is Union:
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        if v is None and len(options) < len(typing.get_args(kind)):
            return None  # Optional[...]
        if len(options) == 1:
            return _from_wire(options[0], v, where)
        return v  # Wire: taken as it came
    if origin is list:
        (item_kind,) = typing.get_args(kind)
        if type(v) is not list:
            raise EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR, f"{where} must be a list")
        return [_from_wire(item_kind, x, f"{where}[{i}]") for i, x in enumerate(v)]
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
    """The daemon itself (``report.server``)."""

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


class _Lookups(WireRow):
    """A row of lookups (``hits``, ``misses`` fields): its :func:`hit_rate` is a
    property, and sent on the wire beside the fields for readers of the dict."""

    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hits, self.misses)

    def to_wire(self) -> dict[str, Wire]:
        out = WireRow.to_wire(self)
        out["hit_rate"] = self.hit_rate
        return out


@dataclasses.dataclass(frozen=True)
class TierRow(_Lookups):
    """Lookups and writes in one tier beyond shared memory: a tenant's
    (``tenants[name].tiers``) or, as :class:`TierTotals`, all tenants' together."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    writes: int = 0
    bytes_out: int = 0


@dataclasses.dataclass(frozen=True)
class TierTotals(TierRow):
    """A tier's lookups and writes of all tenants (``disk.tier``)."""

    lookups: int = 0


@dataclasses.dataclass(frozen=True)
class DiskTenantRow(TierRow):
    """A tenant's row in the disk tier: its lookups and writes, its records there and
    its share of the disk (None: no share set yet)."""

    objects: int = 0
    used_bytes: int = 0
    quota_bytes: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class LocalTierRow(_Lookups):
    """A tenant's lookups in shared memory, beside its other tiers: sent only to the
    control plane (its page shows every tier of a tenant side by side)."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class TenantTiers(WireRow):
    """A tenant's rows in the tiers beyond shared memory, by tier name (a tier the
    daemon runs without has none: the wire map lacks its key)."""

    disk: Optional[DiskTenantRow] = None
    cluster: Optional[TierRow] = None
    local: Optional[LocalTierRow] = None

    @classmethod
    def of(cls, rows: dict[str, TierRow]) -> TenantTiers:
        """The rows of the tiers by their names (``Tier.name``)."""
        return cls(disk=_part(rows, "disk", DiskTenantRow),
                   cluster=_part(rows, "cluster", TierRow))

    def to_wire(self) -> dict[str, Wire]:
        return {k: v for k, v in WireRow.to_wire(self).items() if v is not None}

    def beyond_shared_memory(self) -> list[tuple[str, TierRow]]:
        """(tier name, row) of the tiers beyond shared memory, by name."""
        rows = {"cluster": self.cluster, "disk": self.disk}
        return [(name, row) for name, row in rows.items() if row is not None]


@dataclasses.dataclass(frozen=True)
class TenantRow(PoolStatistics, WireRow):
    """One tenant's pool, its connections and its rows in each tier. ``hit_rate`` is
    :attr:`PoolStatistics.hit_rate`, sent on the wire for readers of the dict."""

    connections: int = 0
    quota_bytes: int = 0
    source: str = ""
    #: whether its shared memory is of huge pages (``ems-server --huge-pages``)
    huge_pages: bool = False
    tiers: TenantTiers = dataclasses.field(default_factory=TenantTiers)

    def to_wire(self) -> dict[str, Wire]:
        out = WireRow.to_wire(self)
        out["hit_rate"] = self.hit_rate
        if not out["tiers"]:
            del out["tiers"]  # as before: the key only when a tier has a row
        return out


@dataclasses.dataclass(frozen=True)
class DiskReport(WireRow):
    """The disk tier (``report.disk``): the disk store's figures (``ems.disk``'s
    ``DiskStatistics`` but its per-tenant rows, which are in ``tenants[name].tiers``)
    and the tier driver's books of it."""

    state: str = ""  # "recovering" | "ok" | "off"
    path: str = ""
    #: "all" | "second-hit"
    admission: str = ""
    capacity_bytes: int = 0
    used_bytes: int = 0
    objects: int = 0
    regions: int = 0
    writes: int = 0
    bytes_written: int = 0
    reads: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_damaged: int = 0
    read_io_errors: int = 0
    #: reads past their deadline (the driver's count)
    read_timeouts: int = 0
    write_latency_p50_s: Optional[float] = None
    write_latency_p99_s: Optional[float] = None
    read_latency_p50_s: Optional[float] = None
    read_latency_p99_s: Optional[float] = None
    refused_no_space: int = 0
    refused_quota: int = 0
    refused_budget: int = 0
    refused_io_error: int = 0
    refused_too_large: int = 0
    regions_evicted: int = 0
    records_recovered: int = 0
    records_scanned: int = 0
    records_dropped_damaged: int = 0
    recovery_s: float = 0.0
    scan_skipped: bool = False
    checkpoints: int = 0
    last_checkpoint_age_s: Optional[float] = None
    direct_io: bool = False
    direct_writes: int = 0
    buffered_writes: int = 0
    direct_reads: int = 0
    buffered_reads: int = 0
    batches_written: int = 0
    disk_bytes_written: int = 0
    #: the driver's books: lookups and writes of all tenants, the write queue, and
    #: why objects were not written (``admissions_refused``: by the store's reason)
    tier: TierTotals = dataclasses.field(default_factory=TierTotals)
    queued_write_bytes: int = 0
    inflight_write_bytes: int = 0
    admissions_refused: dict[str, int] = dataclasses.field(default_factory=dict)
    queue_dropped: int = 0
    evicted_before_write: int = 0
    #: new objects of shared memory not written out, by reason (``queue_full``,
    #: ``admission``, ``caller``, ``evicted_unwritten``, ``write_budget``, ...)
    unwritten: dict[str, int] = dataclasses.field(default_factory=dict)
    #: saves that waited for the writer (shared memory full of unwritten objects)
    save_waits: int = 0
    not_admitted: int = 0
    skipped_caller: int = 0
    skipped_forgotten: int = 0
    #: recovered records announced to KV events after the start
    #: (``disk.announce_recovered``)
    announced_recovered: int = 0
    flushed_on_stop: int = 0


@dataclasses.dataclass(frozen=True)
class ClusterTierRow(TierTotals):
    """The cluster tier's lookups and writes of all tenants, its write-behind and the
    latency of its batches (``cluster.tier``)."""

    write_errors: int = 0
    write_behind_pending_bytes: int = 0
    write_behind_dropped: int = 0
    batches: int = 0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    latency_max_ms: float = 0.0


@dataclasses.dataclass(frozen=True)
class ClusterNodeRow(WireRow):
    """One Valkey node as the cluster tier sees it (``cluster.nodes``)."""

    node: str = ""
    slots: int = 0
    state: str = ""
    ops: int = 0
    errors: int = 0
    skipped: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    last_error: str = ""


@dataclasses.dataclass(frozen=True)
class ClusterReport(WireRow):
    """The cluster tier (``report.cluster``)."""

    seeds: list[str] = dataclasses.field(default_factory=list)
    tls: bool = False
    #: "ok" | "down"
    state: str = ""
    tier: ClusterTierRow = dataclasses.field(default_factory=ClusterTierRow)
    #: MOVED / ASK answers followed
    redirects: dict[str, int] = dataclasses.field(default_factory=dict)
    nodes: list[ClusterNodeRow] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class EventsReport(WireRow):
    """The KV event publisher (``report.kv_events``; cumulative)."""

    published_batches: int = 0
    published_events: int = 0  #: BlockStored/BlockRemoved/AllBlocksCleared sent
    published_hashes: int = 0  #: block hashes in them
    dropped_batches: int = 0  #: the queue was full: the oldest batch dropped
    queued_batches: int = 0  #: waiting to be sent now
    replays: int = 0  #: replay requests served
    tracked_keys: int = 0  #: key -> hash entries kept for BlockRemoved
    untracked_removals: int = 0  #: evicted keys whose hash was not (or no longer) known
    next_seq: int = 0


@dataclasses.dataclass(frozen=True)
class DaemonReport(WireRow):
    """``Daemon.statistics()``: the server row, a row per tenant the caller may see,
    and each tier's or observer's own report under its name (flattened into the wire
    map beside ``server`` and ``tenants``; see the module docstring)."""

    server: ServerRow = dataclasses.field(default_factory=ServerRow)
    tenants: dict[str, TenantRow] = dataclasses.field(default_factory=dict)
    disk: Optional[DiskReport] = None
    cluster: Optional[ClusterReport] = None
    kv_events: Optional[EventsReport] = None
    #: the wire of parts this version has no row for (a newer daemon's), kept as they came
    others: dict[str, Wire] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, server: ServerRow, tenants: dict[str, TenantRow],
           parts: dict[str, WireRow]) -> DaemonReport:
        """The report of a daemon whose tiers and observers reported ``parts`` (by
        their names): each in its field, the rest under ``others``."""
        report = cls(server=server, tenants=tenants,
                     disk=_part(parts, "disk", DiskReport),
                     cluster=_part(parts, "cluster", ClusterReport),
                     kv_events=_part(parts, "kv_events", EventsReport))
        typed = {n for n in _PARTS if getattr(report, n) is not None}
        return dataclasses.replace(report, others={
            n: row.to_wire() for n, row in parts.items() if n not in typed})

    def to_wire(self) -> dict[str, Wire]:
        out: dict[str, Wire] = {"server": self.server.to_wire(),
                                "tenants": {k: t.to_wire() for k, t in self.tenants.items()}}
        for name in _PARTS:
            part = getattr(self, name)
            if part is not None:
                out[name] = part.to_wire()
        out.update(self.others)
        return out

    @classmethod
    def from_wire(cls, row: Wire) -> DaemonReport:
        report = super().from_wire(row)
        assert type(row) is dict  # (checked by WireRow.from_wire)
        return dataclasses.replace(report, others={
            k: v for k, v in row.items() if k not in ("server", "tenants", *_PARTS)})


#: the parts of a report with a row of their own (fields of DaemonReport)
_PARTS = ("disk", "cluster", "kv_events")
