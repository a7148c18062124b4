"""Configuration objects of the SDK and the pool settings read from the environment.

The config classes keep the seeds' names and constructor keywords (``CcConfig``,
``CcConfig_v1``, ``CcKvOption``, ``EmsConfig``). They are plain attribute holders,
because real clients set attributes after construction
(``cc_config_v1.kvcache_type = KVCacheType.MLA``); the rules of the spec are
checked, all at once, by :func:`validate_ems_config` inside ``Ems.init`` and by
:func:`validate_option` on every call. Each rule names the field it checks.

This is the only module that reads ``EMS_*`` environment variables.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from typing import Any, ClassVar, Mapping, Optional

from ems.errors import invalid
from ems.settings import (
    Boolean,
    Choice,
    Integer,
    Layer,
    Size,
    Text,
    check_fields,
    load,
    parse_bytes,
    setting,
)

__all__ = [
    "CcConfig",
    "CcConfig_v1",
    "CcKvOption",
    "EmsConfig",
    "KVCacheType",
    "PoolSettings",
    "MAX_ID_LEN",
    "has_credentials",
    "parse_bytes",
    "v1_from_v0",
    "validate_access_id",
    "validate_access_key",
    "validate_ems_config",
    "validate_option",
]

#: Longest ``access_id``, ``model_id`` and ``llm_engine`` (the docs' bound for ids).
MAX_ID_LEN = 512
_KEY_RE = re.compile(r"[0-9A-Za-z+/=]{32,256}")


class KVCacheType(str, enum.Enum):
    """Attention KV layout of the model; MLA keys do not depend on the TP rank."""

    GQA = "GQA"
    MHA = "MHA"
    MLA = "MLA"
    MQA = "MQA"


class CcKvOption:
    """Per-request options.

    * ``write_rcache`` (default True): also keep the write in the local node's read
      cache. With a single-host pool every write is local, so it has no effect.
    * ``read_local_only`` (default False): reads never go to other nodes. With a
      single-host pool every read is local, so it has no effect.
    * ``timeout`` (ms, default 5000, >= 0): the request's deadline, counted from
      submission. ``0`` means *no deadline*: the request runs to completion (it still
      fails with ``EMS_IO_ERROR`` if the pool is lost).
    * ``write_out`` (default True; an ems extension): False keeps a save's objects in
      the pool's shared memory only: a daemon's tiers (disk, cluster) do not write
      them out, so a one-off prompt never reaches the SSD. Loads are unchanged. The
      embedded pool has no tiers: there it has no effect.
    """

    def __init__(self, write_rcache: bool = True, read_local_only: bool = False,
                 timeout: int = 5000, write_out: bool = True) -> None:
        self.write_rcache = write_rcache
        self.read_local_only = read_local_only
        self.timeout = timeout
        self.write_out = write_out

    def __repr__(self) -> str:
        return (f"CcKvOption(write_rcache={self.write_rcache}, "
                f"read_local_only={self.read_local_only}, timeout={self.timeout}, "
                f"write_out={self.write_out})")


class CcConfig:
    """V0 context-caching config (``rank_id``, ``device_id``, ``model_id`` required)."""

    def __init__(self, rank_id: int, device_id: int, model_id: str,
                 tp_world_size: int = 1, pp_world_size: int = 1) -> None:
        self.rank_id = rank_id
        self.device_id = device_id
        self.model_id = model_id
        self.tp_world_size = tp_world_size
        self.pp_world_size = pp_world_size

    def _fields(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._fields().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]


class CcConfig_v1(CcConfig):  # noqa: N801 - the seeds' name
    """V1 config: the parallel position of this rank and the engine name.

    ``kvcache_type`` is an attribute (default ``KVCacheType.MHA``); set it to
    ``KVCacheType.MLA`` for MLA models, whose TP ranks hold identical KV.
    """

    def __init__(self, rank_id: int, device_id: int, model_id: str,
                 tp_world_size: int = 1, pp_world_size: int = 1,
                 rank_in_tp_group: int = 0, rank_in_pp_group: int = 0,
                 llm_engine: str = "default",
                 kvcache_type: KVCacheType = KVCacheType.MHA) -> None:
        super().__init__(rank_id, device_id, model_id, tp_world_size, pp_world_size)
        self.rank_in_tp_group = rank_in_tp_group
        self.rank_in_pp_group = rank_in_pp_group
        self.llm_engine = llm_engine
        self.kvcache_type = kvcache_type


def v1_from_v0(cc: CcConfig) -> CcConfig_v1:
    """The V1 config of a V0 ``CcConfig`` (V1 calls after a V0 ``Ems.init``, as in the
    official ``register_kvcache`` sample): ``llm_engine`` "vllm", ``kvcache_type`` MHA,
    and this rank's tp/pp positions from ``rank_id`` with tp fastest (vLLM's and
    Megatron's numbering) -- 0 and 0 for the sample's world sizes of 1 -- so TP/PP ranks
    keep distinct storage keys."""
    tp, pp = cc.tp_world_size, cc.pp_world_size
    return CcConfig_v1(cc.rank_id, cc.device_id, cc.model_id, tp, pp,
                       rank_in_tp_group=cc.rank_id % tp,
                       rank_in_pp_group=(cc.rank_id // tp) % pp,
                       llm_engine="vllm", kvcache_type=KVCacheType.MHA)


class EmsConfig:
    """Top-level config of :meth:`Ems.init`."""

    def __init__(self, access_id: Optional[str] = None, access_key: Optional[str] = None,
                 cc_config: Optional[CcConfig] = None,
                 cc_config_v1: Optional[CcConfig_v1] = None) -> None:
        self.access_id = access_id
        self.access_key = access_key
        self.cc_config = cc_config
        self.cc_config_v1 = cc_config_v1

    def __repr__(self) -> str:  # never print the secret
        key = None if self.access_key is None else "***"
        return (f"EmsConfig(access_id={self.access_id!r}, access_key={key}, "
                f"cc_config={self.cc_config!r}, cc_config_v1={self.cc_config_v1!r})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmsConfig) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- rules

def _int(value: Any, field: str, minimum: int, maximum: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{field} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise invalid(f"{field} must be >= {minimum}, got {value}")
    if maximum is not None and value >= maximum:
        raise invalid(f"{field} must be < {maximum}, got {value}")


def _bool(value: Any, field: str) -> None:
    if not isinstance(value, bool):
        raise invalid(f"{field} must be a bool, got {type(value).__name__}")


def _ident(value: Any, field: str) -> None:
    """An id as real deployments write them (``cc_kvstore@_@ds_default_ns_001``,
    ``vllm@svc``, ``org/Model-7B:v2``): 1-512 printable characters. Refused is only
    what would break a storage key, a log line or the wire: a non-str, the empty
    string, control characters (and unpaired surrogates, which cannot be encoded),
    and over-long values."""
    if not isinstance(value, str):
        raise invalid(f"{field} must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_ID_LEN:
        raise invalid(f"{field} must be 1-{MAX_ID_LEN} characters, got {len(value)}")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise invalid(f"{field} must not hold control or unprintable characters, got "
                      f"{bad!r} in {value[:64]!r}")


def validate_option(option: Any, *, required: bool) -> "CcKvOption":
    """Check a :class:`CcKvOption`; ``None`` is the default option unless required."""
    if option is None:
        if required:
            raise invalid("option must not be None (V0 calls need a CcKvOption)")
        return CcKvOption()
    if not isinstance(option, CcKvOption):
        raise invalid(f"option must be a CcKvOption, got {type(option).__name__}")
    t = option.timeout
    if type(option.write_rcache) is bool and type(option.read_local_only) is bool and \
            type(t) is int and t >= 0 and type(option.write_out) is bool:
        return option  # every call checks: the valid case inline
    _bool(option.write_rcache, "option.write_rcache")
    _bool(option.read_local_only, "option.read_local_only")
    _int(option.timeout, "option.timeout", 0)
    _bool(option.write_out, "option.write_out")
    return option


def _validate_cc(cc: Any, name: str, v1: bool) -> None:
    cls = CcConfig_v1 if v1 else CcConfig
    if not isinstance(cc, cls):
        raise invalid(f"{name} must be a {cls.__name__}, got {type(cc).__name__}")
    _int(cc.rank_id, f"{name}.rank_id", 0)
    _int(cc.device_id, f"{name}.device_id", 0)
    _ident(cc.model_id, f"{name}.model_id")
    _int(cc.tp_world_size, f"{name}.tp_world_size", 1)
    _int(cc.pp_world_size, f"{name}.pp_world_size", 1)
    if v1:
        assert isinstance(cc, CcConfig_v1)
        _int(cc.rank_in_tp_group, f"{name}.rank_in_tp_group", 0, cc.tp_world_size)
        _int(cc.rank_in_pp_group, f"{name}.rank_in_pp_group", 0, cc.pp_world_size)
        _ident(cc.llm_engine, f"{name}.llm_engine")
        try:
            cc.kvcache_type = KVCacheType(cc.kvcache_type)
        except ValueError:
            kinds = ", ".join(k.value for k in KVCacheType)
            raise invalid(f"{name}.kvcache_type must be one of {kinds}, "
                          f"got {cc.kvcache_type!r}") from None


def has_credentials(config: "EmsConfig") -> bool:
    """Whether ``config`` presents credentials. An empty or ``None`` ``access_key`` means
    *no credentials* (the anonymous namespace), whatever ``access_id`` says: the real
    EMS adapter ships ``access_key=""`` with an ``access_id`` in its defaults."""
    return config.access_key is not None and config.access_key != ""


def validate_access_id(access_id: Any) -> str:
    """The SDK's rule for a tenant's ``access_id`` (1-512 printable characters of any
    kind; see ``_ident``), for everything that names a tenant: an SDK config with
    credentials, the daemon's tenants file, the control plane's API and the registry a
    daemon fetches from it. Returns it; raises ``EMS_INVALID_ARGUMENT`` naming the rule."""
    _ident(access_id, "access_id")
    return str(access_id)


def validate_access_key(access_key: Any) -> str:
    """The SDK's rule for an ``access_key`` that is given: 32-256 characters of
    ``0-9 A-Z a-z + / =``."""
    if not isinstance(access_key, str) or not _KEY_RE.fullmatch(access_key):
        raise invalid("access_key must be 32-256 characters of 0-9 A-Z a-z + / = "
                      "(or empty / None for anonymous access)")
    return access_key


def validate_ems_config(config: Any) -> None:
    """Apply every rule of the spec to an :class:`EmsConfig`; raise on the first break."""
    if not isinstance(config, EmsConfig):
        raise invalid(f"config must be an EmsConfig, got {type(config).__name__}")
    if has_credentials(config):
        if config.access_id is None:
            raise invalid("access_key needs an access_id (or leave access_key empty for "
                          "anonymous access)")
        validate_access_id(config.access_id)
        validate_access_key(config.access_key)
    elif config.access_id is not None and not isinstance(config.access_id, str):
        # Not used without a key (anonymous), but it is logged: it must be text.
        raise invalid(f"access_id must be a str or None, got {type(config.access_id).__name__}")
    if config.cc_config is not None:
        _validate_cc(config.cc_config, "cc_config", v1=False)
    if config.cc_config_v1 is not None:
        _validate_cc(config.cc_config_v1, "cc_config_v1", v1=True)


# --------------------------------------------------------------------------- pool

def _default_capacity() -> int:
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        phys = 8 << 30
    return min(4 << 30, phys // 4)


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """Where the SDK finds its pool, from the environment (each variable declared once
    below; docs/sdk.md's table is made from these declarations).

    ``EMS_SPIN_US``: a reply comes in ~30-50 us; a thread that sleeps for it pays a
    wake-up and runs cold afterwards (on a VM, ~10-20 us of a ~100 us call), so a
    synchronous call polls first. Asynchronous requests never spin.

    ``EMS_CUDA_REGISTER``: registered pool memory lets GPU copies run at the link's
    speed instead of through the driver's pageable bounce buffer; ``0`` is for hosts
    whose memlock limit or container refuses it (the refusal is logged once, counted,
    and copies stay pageable).
    """

    mode: str = setting(
        "embedded, server or auto: the daemon when its socket exists in EMS_SOCKET_DIR, "
        "else the embedded pool", Choice(("auto", "embedded", "server"), fold="lower"),
        default="auto", key=None, env="EMS_POOL")
    socket_dir: str = setting("directory of the daemon's socket", Text(),
                              default="/dev/shm/ems", key=None, env="EMS_SOCKET_DIR")
    capacity_bytes: int = setting(
        "embedded pool size (pages are only used when written)", Size(),
        default_factory=_default_capacity, shown="min(4G, RAM/4)", key=None,
        env="EMS_CAPACITY")
    connect_timeout_ms: int = setting("bound on reaching the daemon in Ems.init",
                                      Integer(1), default=3000, key=None,
                                      env="EMS_CONNECT_TIMEOUT_MS")
    workers: int = setting("threads that run requests of one ContextCaching", Integer(1),
                           default=4, key=None, env="EMS_WORKERS")
    spin_us: int = setting(
        "how long a synchronous save/load polls for the daemon's reply before it sleeps, "
        "microseconds (0: sleep at once)", Integer(0, 1_000_000), default=200, key=None,
        env="EMS_SPIN_US")
    cuda_register: bool = setting(
        "register the pool memory this process maps with CUDA (cudaHostRegister, in the "
        "background, once per segment) where it copies GPU memory", Boolean(),
        default=True, key=None, env="EMS_CUDA_REGISTER")
    cuda_staging_bytes: int = setting(
        "device staging memory per direction per GPU for V1 CUDA caches (grown to one "
        "block's object where a block is larger)", Size(), default=32 << 20, key=None,
        env="EMS_CUDA_STAGING")

    #: the daemon's socket file inside ``socket_dir``
    SOCKET_NAME: ClassVar[str] = "ems.sock"

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.socket_dir, self.SOCKET_NAME)

    def resolved_mode(self) -> str:
        """``embedded`` or ``server``: the pool ``Ems.init`` picks with these settings."""
        if self.mode != "auto":
            return self.mode
        return "server" if os.path.exists(self.socket_path) else "embedded"

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "PoolSettings":
        return load(cls, [Layer.environ(os.environ if env is None else env)])
