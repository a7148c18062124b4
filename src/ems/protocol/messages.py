"""The messages of the ems wire protocol, and their checked msgpack form.

Every message is a frozen dataclass; on the wire it is the msgpack array
``[type_code, field_1, field_2, ...]``. Decoding checks the type of every field (and
that parallel lists have equal lengths), so the daemon's request handlers only ever
see well-formed values: anything else is ``EMS_PROTOCOL_ERROR`` and the connection
closes.

A connection goes through two phases::

    client                                   daemon
    Ping(rid)                        ->      Pong(rid)   (a probe: allowed before Hello)
    Hello(access_id, admin)          ->
                                     <-      Challenge(nonce)       (access_id given)
    Auth(mac)                        ->
                                     <-      Welcome(...) + memfd   (SCM_RIGHTS)
                                             or Error(EMS_AUTH_FAILED) and close
    ---------------------------- ready ----------------------------------------
    Reserve(rid, keys, sizes,        ->      Granted(rid, statuses, tokens, offsets, sizes)
            write_rcache, hashes,
            write_out, budget_ms)
    Commit(rid, tokens, budget_ms)   ->      Committed(rid, ok)
    Abort(tokens)                    ->      (no reply)
    Acquire(rid, keys, sizes,        ->      Pinned(rid, tokens, offsets, sizes)
            local_only, budget_ms)
    Release(tokens)                  ->      (no reply)
    Exists(rid, keys, sizes,         ->      Count(rid, n)
           local_only, budget_ms)
    Lease(rid)                       ->      Leased(rid, offset, size)   (size 0: no room)
    Put(rid, keys, offsets, sizes,   ->      Stored(rid, ok, lease_offset, lease_size)
        want_lease, write_rcache,
        budget_ms, hashes, write_out)
    Return(offsets, sizes)           ->      (no reply)
    Stats(rid, all_tenants)          ->      StatsReply(rid, stats)
    Ping(rid)                        ->      Pong(rid)
    any request                      ->      Error(rid, code, message)

The options of a request travel with it (``write_rcache``, ``local_only`` =
``read_local_only``, ``budget_ms`` = what is left of its deadline): a daemon with a
cluster tier (``ems.server.cluster_tier``) acts on them, a single-host one ignores
them. A cluster daemon may answer an Acquire, Exists, Put or Commit later than
requests sent after it (after its cluster round trip): replies are matched by rid.
The option fields are the last ones and have defaults; a sender may leave them off
(``validate`` fills in the defaults: what the request meant before they existed).

``hashes`` (Reserve, Put; None or one unsigned 64-bit int per key): the engine's own
block hash of each key (vLLM's, as it publishes them in its KV events), which a daemon
with KV events (``ems.server.kv_events``) publishes when the keys are stored; it
changes nothing else.

``write_out`` (Reserve, Put; CcKvOption.write_out, default True): False keeps the new
objects of the save in shared memory only: the daemon's tiers do not write them out (no
disk record, no cluster write-behind; counted as ``skipped_caller``). A client leaves
the field off when it is True, so a daemon from before it takes the request as before.

``budget_ms`` of a Reserve (after ``write_out``): what is left of the save's deadline,
which bounds how long a daemon with a disk tier lets the Reserve wait for the disk's
writer (back-pressure: at most half of it, ``ems.server.handlers``). Left off when 0
(no deadline), as ``write_out`` when True (:func:`trimmed`).

``rid`` (request id, > 0) is chosen by the client and echoed in the reply, so many
requests of one client share one connection; ``Error`` with ``rid == 0`` is about
the connection itself (sent just before the daemon closes it). Batches keep a save of
N keys at two round trips (reserve, commit), one through the lease (put), and a load
at one plus a one-way release.

A small save takes one round trip: the client writes into its connection's LEASE
(pool space it owns, of the size ``Welcome.lease_size`` announced) without asking, and ``Put``
carves each written range into a committed key (or frees it: EXISTS/BUSY); ``Return``
gives back ranges it will not put (an aborted save, the tail of a used-up lease), and
``want_lease`` asks for a fresh lease with the reply. The daemon only accepts ranges
of the connection's own lease.

The access key never crosses the socket: ``Auth.mac`` is :func:`auth_mac` of the
daemon's fresh nonce.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import operator
import sys
import types
from typing import Any, Callable, ClassVar, Optional, TypeVar

from ems.errors import EmsErrorCode, EmsException

_T = TypeVar("_T")

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # (only type checkers read it)
    def dataclass_transform(**_kwargs: object) -> Callable[[_T], _T]:
        return lambda f: f

__all__ = [
    "MESSAGES",
    "Abort",
    "Acquire",
    "Auth",
    "Challenge",
    "Commit",
    "Committed",
    "Count",
    "Error",
    "Exists",
    "GrantStatus",
    "Granted",
    "Hello",
    "Lease",
    "Leased",
    "Message",
    "Ping",
    "Pinned",
    "Pong",
    "Put",
    "Release",
    "Reserve",
    "Return",
    "Stats",
    "StatsReply",
    "Stored",
    "Welcome",
    "auth_mac",
    "from_wire",
    "trimmed",
    "wire_class",
]

_U64 = 1 << 64


class GrantStatus(enum.IntEnum):
    """A key's status in a ``Granted`` reply (the values of ``ems.pool.core``'s
    ``GrantStatus``, which the daemon sends: a unit test pins them equal)."""

    NEW = 0  #: space reserved: write the bytes, then commit the token
    EXISTS = 1  #: already stored (write-once): nothing to copy, counts as stored
    BUSY = 2  #: another writer holds a reservation: counts as stored
    FULL = 3  #: no room even after evicting every evictable object
    TOO_LARGE = 4  #: bigger than the whole pool


def _bad(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR, message)


# ----------------------------------------------------------------------- field checks
# Each check returns True when the decoded value (any object msgpack gave) has the
# right shape.

#: a field's check
Check = Callable[[object], bool]

def _uint(v: object) -> bool:
    return type(v) is int and 0 <= v < _U64


def _rid(v: object) -> bool:
    return type(v) is int and 0 < v < _U64


def _bool(v: object) -> bool:
    return type(v) is bool


def _str(v: object) -> bool:
    return type(v) is str


def _bytes(v: object) -> bool:
    return type(v) is bytes


def _num(v: object) -> bool:
    return (type(v) is int or type(v) is float) and v >= 0


def _power_of_two(v: object) -> bool:
    return type(v) is int and 0 < v < _U64 and v & (v - 1) == 0


def _opt(check: Check) -> Check:
    def optional(v: object) -> bool:
        return v is None or check(v)
    optional.inner = check  # type: ignore[attr-defined]  # (for _validator)
    return optional


# The lists every request and reply carries get loops without a call per element.

def _uints(v: object) -> bool:
    if type(v) is not list:
        return False
    for x in v:
        if type(x) is not int or not 0 <= x < _U64:
            return False
    return True


def _strs(v: object) -> bool:
    if type(v) is not list:
        return False
    for x in v:
        if type(x) is not str:
            return False
    return True


def _bools(v: object) -> bool:
    if type(v) is not list:
        return False
    for x in v:
        if type(x) is not bool:
            return False
    return True


def _tree(v: object, depth: int = 0) -> bool:
    """Plain JSON-like data (the statistics report)."""
    if depth > 8:
        return False
    if v is None or type(v) in (bool, int, float, str):
        return True
    if type(v) is list:
        return all(_tree(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(type(k) is str and _tree(x, depth + 1) for k, x in v.items())
    return False


_NO_DEFAULT: object = dataclasses.MISSING


def _field(check: Check, default: object = _NO_DEFAULT) -> Any:
    """A field and its check; a ``default`` only lets code build the message without
    it (the wire form always carries every field). Any: the field's own annotation
    types it (as ``dataclasses.field``)."""
    return dataclasses.field(default=default, metadata={"check": check})


# ----------------------------------------------------------------------- base

class Message:
    """Base of every wire message (``TYPE`` is its code on the wire).

    ``_NAMES``/``_CHECKS``/``_PARALLEL_IDX`` are computed once per class when it is
    registered (``dataclasses.fields()`` per call cost several microseconds of a
    ~10 us decode, on every request and reply).
    """

    TYPE: ClassVar[int]
    #: tuples of field names that must hold lists of equal length
    PARALLEL: ClassVar[tuple[tuple[str, ...], ...]] = ()
    _NAMES: ClassVar[tuple[str, ...]] = ()
    _CHECKS: ClassVar[tuple[Check, ...]] = ()
    #: defaults of the trailing fields a sender may leave off (the request options)
    _DEFAULTS: ClassVar[tuple[object, ...]] = ()
    _PARALLEL_IDX: ClassVar[tuple[tuple[int, ...], ...]] = ()

    _fields_of: ClassVar[Callable[[Message], tuple[object, ...]]]
    #: the wire form from the fields by name (see ``_wire_builder``)
    wire: ClassVar[Callable[..., list[object]]]

    def to_wire(self) -> list[object]:
        return [self.TYPE, *type(self)._fields_of(self)]

    #: ``validate(values)``: check decoded field values and return them as they are
    #: (the daemon's hot path uses them positionally, without a message object);
    #: generated per class (see ``_validator``), same answers as :meth:`validate_slow`.
    #: The values come back as ``Any``: each has its field's type, which differs by
    #: position (the daemon's handlers unpack them knowing the message).
    validate: ClassVar[Callable[[list[object]], list[Any]]]

    @classmethod
    def check(cls, values: list[object]) -> "Message":
        """The message of decoded field values, checked (``EMS_PROTOCOL_ERROR``).
        Built without the frozen ``__init__`` (one ``object.__setattr__`` per field
        made it ~1 us of a ~2.5 us reply decode): the values are checked already."""
        values = cls.validate(values)
        msg = _new(cls)
        msg.__dict__.update(zip(cls._NAMES, values))
        return msg

    @classmethod
    def validate_slow(cls, values: list[object]) -> list[Any]:
        """The reference check, field by field with the field's own function: what
        the generated ``validate`` falls back to for its error message."""
        checks = cls._CHECKS
        if len(values) != len(checks):
            # Trailing option fields (those with a default) may be left off: the
            # request then means what it meant before they existed.
            missing = len(checks) - len(values)
            if not 0 < missing <= len(cls._DEFAULTS):
                raise _bad(f"{cls.__name__} has {len(checks)} fields, got {len(values)}")
            values = [*values, *cls._DEFAULTS[len(cls._DEFAULTS) - missing:]]
        for check, value in zip(checks, values):
            if not check(value):
                i = next(j for j, (c, v) in enumerate(zip(checks, values)) if not c(v))
                raise _bad(f"{cls.__name__}.{cls._NAMES[i]} has the wrong type or range: "
                           f"{_short(value)}")
        checked: list[Any] = values  # (each of its field's type now: a group's are lists)
        for group in cls._PARALLEL_IDX:
            if len({len(checked[i]) for i in group if checked[i] is not None}) > 1:
                raise _bad(f"{cls.__name__}: {', '.join(cls._NAMES[i] for i in group)} "
                           f"must have equal lengths")
        return checked


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


MESSAGES: dict[int, type[Message]] = {}
_M = TypeVar("_M", bound=Message)


@dataclass_transform(frozen_default=True, field_specifiers=(_field,))
def _message(code: int) -> Callable[[type[_M]], type[_M]]:
    def register(cls: type[_M]) -> type[_M]:
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.TYPE = code
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # (a dataclass now)
        cls._NAMES = tuple(f.name for f in fields)
        cls._CHECKS = tuple(f.metadata["check"] for f in fields)
        trailing: list[object] = []
        for f in reversed(fields):  # the defaults of the trailing optional fields
            if f.default is dataclasses.MISSING:
                break
            trailing.insert(0, f.default)
        cls._DEFAULTS = tuple(trailing)
        get = operator.attrgetter(*cls._NAMES)  # (one name: a value, not a tuple)
        cls._fields_of = staticmethod(get if len(cls._NAMES) > 1 else lambda msg: (get(msg),))
        cls._PARALLEL_IDX = tuple(tuple(cls._NAMES.index(n) for n in group)
                                  for group in cls.PARALLEL)
        cls.wire = staticmethod(_wire_builder(code, cls.__name__, fields))
        cls.validate = staticmethod(_validator(cls, fields))
        assert code not in MESSAGES
        MESSAGES[code] = cls
        return cls
    return register


def _wire_builder(code: int, name: str, fields: tuple[dataclasses.Field[object], ...]
                  ) -> Callable[..., list[object]]:
    """``Cls.wire(field=..., ...)``: the wire form ``[TYPE, field, ...]`` of a message
    from its fields BY NAME (keyword-only), in the order of its one definition above,
    without building the object (the hot requests and every reply of the daemon).
    Generated once per class: a keyword call of a plain function costs ~0.2 us, a
    frozen dataclass plus ``to_wire`` ~1.5 us."""
    params: list[str] = []
    env: dict[str, object] = {}
    for i, f in enumerate(fields):
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            env[f"_d{i}"] = f.default
            params.append(f"{f.name}=_d{i}")
    names = [f.name for f in fields]
    src = (f"def wire(*, {', '.join(params)}):\n"
           f"    return [{code}, {', '.join(names)}]\n")
    exec(src, env)  # noqa: S102 - built from our own field names only
    builder = env["wire"]
    assert isinstance(builder, types.FunctionType)
    builder.__qualname__ = f"{name}.wire"
    return builder


_new = object.__new__
_U64_LIMIT = _U64
#: The checks ``_validator`` writes inline (the others it calls)
_INLINE = {
    "_uint": "(type({x}) is int and 0 <= {x} < _U64)",
    "_rid": "(type({x}) is int and 0 < {x} < _U64)",
    "_bool": "(type({x}) is bool)",
    "_str": "(type({x}) is str)",
    "_bytes": "(type({x}) is bytes)",
    "_num": "(type({x}) in _NUM and {x} >= 0)",
}


def _validator(cls: type[Message], fields: tuple[dataclasses.Field[object], ...]
               ) -> Callable[[list[object]], list[Any]]:
    """A ``validate`` for ``cls`` with every field's check written out in one function
    (a call per field through ``_CHECKS`` cost ~1.5 us of a 5-field request; this
    ~0.5 us). On any failure it calls ``validate_slow``, which names the field."""
    env: dict[str, object] = {"_U64": _U64_LIMIT, "_NUM": (int, float),
                           "_slow": cls.validate_slow}
    names = [f"f{i}" for i in range(len(fields))]
    terms = []
    optional = set()
    for i, f in enumerate(fields):
        check, x = f.metadata["check"], names[i]
        inner = getattr(check, "inner", None)
        if inner is not None:
            optional.add(i)
            check = inner
        inline = _INLINE.get(getattr(check, "__name__", ""))
        if inline is not None:
            term = inline.format(x=x)
        else:
            env[f"_c{i}"] = check
            term = f"_c{i}({x})"
        terms.append(f"({x} is None or {term})" if i in optional else term)
    for group in cls._PARALLEL_IDX:
        first = group[0]
        assert first not in optional  # (a group is measured by its first list)
        for j in group[1:]:
            same = f"len({names[j]}) == len({names[first]})"
            terms.append(f"({names[j]} is None or {same})" if j in optional else same)
    src = (f"def validate(values):\n"
           f"    if len(values) != {len(fields)}:\n"
           f"        return _slow(values)\n"
           f"    {', '.join(names)}{',' if len(names) == 1 else ''} = values\n"
           f"    if {' and '.join(terms)}:\n"
           f"        return values\n"
           f"    return _slow(values)\n")
    exec(src, env)  # noqa: S102 - built from our own field names and checks only
    validate = env["validate"]
    assert isinstance(validate, types.FunctionType)
    return validate


def from_wire(obj: object) -> Message:
    """Check and build the message of a decoded msgpack body."""
    cls = wire_class(obj)
    assert type(obj) is list  # (wire_class checked it)
    return cls.check(obj[1:])


def trimmed(wire: list[object], newer: int) -> list[object]:
    """``wire`` (a request's wire form) as sent: of its last ``newer`` fields (the
    options added since a daemon a client may still meet), each left off from the end
    while it holds its default, so a daemon from before them takes a request that does
    not use them as before (``validate`` fills them in again)."""
    cls = MESSAGES[wire[0]]  # type: ignore[index]
    for default in reversed(cls._DEFAULTS[len(cls._DEFAULTS) - newer:]):
        last = wire[-1]
        if type(last) is not type(default) or last != default:
            break
        del wire[-1]
    return wire


def wire_class(obj: object) -> type[Message]:
    """The message class a decoded msgpack body claims to be (its fields unchecked)."""
    if type(obj) is not list or not obj or type(obj[0]) is not int:
        raise _bad("a message must be an array that starts with its type code")
    cls = MESSAGES.get(obj[0])
    if cls is None:
        raise _bad(f"unknown message type {obj[0]}")
    return cls


def auth_mac(access_key: str, nonce: bytes, access_id: str) -> bytes:
    """What a client proves it holds ``access_key`` with (HMAC-SHA256 of the nonce)."""
    msg = b"ems-auth-v1\x00" + nonce + b"\x00" + access_id.encode()
    return hmac.new(access_key.encode(), msg, hashlib.sha256).digest()


# ----------------------------------------------------------------------- handshake

@_message(1)
class Hello(Message):
    """First client message. ``access_id`` None = anonymous; ``admin`` asks for an
    admin session (statistics only), granted to the daemon's own uid and root."""

    access_id: Optional[str] = _field(_opt(_str))
    admin: bool = _field(_bool)


@_message(2)
class Challenge(Message):
    nonce: bytes = _field(_bytes)


@_message(3)
class Auth(Message):
    mac: bytes = _field(_bytes)


@_message(4)
class Welcome(Message):
    """Session accepted. A tenant session comes with the tenant's memfd (SCM_RIGHTS):
    ``segment_size`` bytes of pool memory, named ``segment_id`` in this daemon.
    ``max_keys``: the most keys (or tokens, or ranges) one request may carry."""

    tenant: str = _field(_str)
    segment_id: int = _field(_uint)
    segment_size: int = _field(_uint)
    reservation_ttl_s: float = _field(_num)
    server: str = _field(_str)
    #: the daemon's max_keys_per_request: the client sends batches in such slices
    max_keys: int = _field(_uint)
    #: the pool's allocation unit: every range of the lease a client cuts is aligned
    #: to it (the daemon checks each range of a Put)
    align: int = _field(_power_of_two)
    #: size of one lease (0: the daemon hands out none); a save of at most a quarter
    #: of it goes through the lease
    lease_size: int = _field(_uint)


# ----------------------------------------------------------------------- requests

@_message(10)
class Reserve(Message):
    """``write_rcache`` False: the values go to the cluster's home node only (a
    cluster daemon sends them at Commit and keeps no local copy). ``budget_ms``: what
    is left of the save's deadline (0: none), which bounds the Reserve's wait for a
    disk's writer."""

    rid: int = _field(_rid)
    keys: list = _field(_strs)
    sizes: list = _field(_uints)
    write_rcache: bool = _field(_bool, True)
    hashes: Optional[list] = _field(_opt(_uints), None)
    write_out: bool = _field(_bool, True)
    budget_ms: int = _field(_uint, 0)
    PARALLEL = (("keys", "sizes", "hashes"),)


@_message(11)
class Commit(Message):
    """``budget_ms``: what is left of the request's deadline (0: none), which bounds a
    cluster daemon's write to the home node."""

    rid: int = _field(_rid)
    tokens: list = _field(_uints)
    budget_ms: int = _field(_uint, 0)


@_message(12)
class Abort(Message):
    tokens: list = _field(_uints)


@_message(13)
class Acquire(Message):
    """``local_only`` (CcKvOption.read_local_only): a cluster daemon does not go to the
    home nodes for the keys its local pool missed; ``budget_ms`` bounds that (0: no
    deadline)."""

    rid: int = _field(_rid)
    keys: list = _field(_strs)
    sizes: Optional[list] = _field(_opt(_uints))
    local_only: bool = _field(_bool, False)
    budget_ms: int = _field(_uint, 0)
    PARALLEL = (("keys", "sizes"),)


@_message(14)
class Release(Message):
    tokens: list = _field(_uints)


@_message(15)
class Exists(Message):
    """``local_only``/``budget_ms`` as for :class:`Acquire`."""

    rid: int = _field(_rid)
    keys: list = _field(_strs)
    sizes: Optional[list] = _field(_opt(_uints))
    local_only: bool = _field(_bool, False)
    budget_ms: int = _field(_uint, 0)
    PARALLEL = (("keys", "sizes"),)


@_message(16)
class Stats(Message):
    rid: int = _field(_rid)
    all_tenants: bool = _field(_bool)


@_message(17)
class Ping(Message):
    rid: int = _field(_rid)


@_message(18)
class Lease(Message):
    rid: int = _field(_rid)


@_message(19)
class Put(Message):
    """Commit values written into the connection's lease at ``offsets``.
    ``write_rcache`` False: a cluster daemon sends them to the home node only and
    gives the ranges back (no local copy); ``budget_ms`` bounds that (0: none)."""

    rid: int = _field(_rid)
    keys: list = _field(_strs)
    offsets: list = _field(_uints)
    sizes: list = _field(_uints)
    want_lease: bool = _field(_bool)
    write_rcache: bool = _field(_bool, True)
    budget_ms: int = _field(_uint, 0)
    hashes: Optional[list] = _field(_opt(_uints), None)
    write_out: bool = _field(_bool, True)
    PARALLEL = (("keys", "offsets", "sizes", "hashes"),)


@_message(20)
class Return(Message):
    """Give back ranges of the connection's lease (ranges not in it are ignored)."""

    offsets: list = _field(_uints)
    sizes: list = _field(_uints)
    PARALLEL = (("offsets", "sizes"),)


# ----------------------------------------------------------------------- replies

@_message(30)
class Granted(Message):
    """One entry per key: a ``GrantStatus`` value, and token/offset/size for NEW."""

    rid: int = _field(_rid)
    statuses: list = _field(_uints)
    tokens: list = _field(_uints)
    offsets: list = _field(_uints)
    sizes: list = _field(_uints)
    PARALLEL = (("statuses", "tokens", "offsets", "sizes"),)


@_message(31)
class Committed(Message):
    rid: int = _field(_rid)
    ok: list = _field(_bools)


@_message(32)
class Pinned(Message):
    """The leading hits, pinned until released."""

    rid: int = _field(_rid)
    tokens: list = _field(_uints)
    offsets: list = _field(_uints)
    sizes: list = _field(_uints)
    PARALLEL = (("tokens", "offsets", "sizes"),)


@_message(33)
class Count(Message):
    rid: int = _field(_rid)
    n: int = _field(_uint)


@_message(34)
class StatsReply(Message):
    rid: int = _field(_rid)
    stats: dict = _field(lambda v: type(v) is dict and _tree(v))


@_message(35)
class Pong(Message):
    rid: int = _field(_rid)


@_message(37)
class Leased(Message):
    """A lease of ``size`` bytes at ``offset`` (size 0: no room now)."""

    rid: int = _field(_rid)
    offset: int = _field(_uint)
    size: int = _field(_uint)


@_message(38)
class Stored(Message):
    """Per key of a Put, whether it is stored (EXISTS and BUSY count as stored), and a
    fresh lease when one was asked for (``lease_size`` 0: none)."""

    rid: int = _field(_rid)
    ok: list = _field(_bools)
    lease_offset: int = _field(_uint)
    lease_size: int = _field(_uint)


@_message(36)
class Error(Message):
    """``code`` is an ``EmsErrorCode`` value; ``rid`` 0 is about the connection."""

    rid: int = _field(_uint)
    code: int = _field(_uint)
    message: str = _field(_str)

    def exception(self) -> EmsException:
        try:
            code = EmsErrorCode(self.code)
        except ValueError:
            code = EmsErrorCode.EMS_INTERNAL_ERROR
        return EmsException(code, self.message)
