"""Settings of the engine integrations: the engine's extra config first (vLLM's
``kv_connector_extra_config``, SGLang's ``hicache_storage_backend_extra_config``), then
the ``EMS_VLLM_*`` / ``EMS_SGLANG_*`` environment, then the defaults below.

Every field has a default, a unit in its name and a rule; an unknown key or a bad
value raises ``EMS_INVALID_ARGUMENT`` naming the key (fail closed: a typo in a
deadline must not silently keep the default). Where the pool is (``EMS_POOL``,
``EMS_SOCKET_DIR``, ``EMS_CONNECT_TIMEOUT_MS``) is the SDK's own environment; the
``pool`` / ``socket_dir`` keys, when given, are exported to it before ``Ems.init``.
Credentials: ``access_id`` / ``access_key`` keys or ``EMS_ACCESS_ID`` /
``EMS_ACCESS_KEY``.

* :class:`PoolSettings` -- what every integration's pool session needs.
* :class:`ConnectorSettings` -- vLLM's KV connector.
* :class:`StorageSettings` -- SGLang's HiCache storage backend.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar, Mapping, Optional, TypeVar

from ems.config import CcKvOption
from ems.errors import invalid

__all__ = ["ConnectorSettings", "PoolSettings", "StorageSettings"]

_S = TypeVar("_S", bound="PoolSettings")


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """Whom the integration talks to, and the deadlines of its pool session."""

    #: ``embedded`` | ``server`` | ``auto`` (exported as EMS_POOL); None: the environment's
    pool: Optional[str] = None
    #: the daemon's socket directory (exported as EMS_SOCKET_DIR); None: the environment's
    socket_dir: Optional[str] = None
    access_id: Optional[str] = None
    access_key: Optional[str] = None
    #: deadline of one lookup (``exists``); past it the lookup answers "no cache".
    #: A lookup answers in ~0.1 ms on a local daemon; 200 ms only ever passes when
    #: the pool hangs.
    lookup_timeout_ms: int = 200
    #: deadline of one load (the engine waits for it)
    load_timeout_ms: int = 5000
    #: deadline of one save
    save_timeout_ms: int = 10000
    #: how often a down pool is probed (``Ems.check_health``), and an up one checked
    health_interval_s: float = 10.0
    #: the saves' ``CcKvOption.write_out``: false keeps them in the pool's shared
    #: memory only (a daemon's disk and cluster tiers do not write them out); vLLM
    #: takes a request's own ``kv_transfer_params["ems_write_out"]`` over it
    write_out: bool = True

    #: the environment's prefix of these fields (``EMS_VLLM_`` + the upper-case name)
    _ENV_PREFIX: ClassVar[str] = ""
    #: what the engine calls the mapping these settings come from (for messages)
    _WHERE: ClassVar[str] = "extra_config"
    #: the engine's own keys in that mapping: passed over, never refused
    _ENGINE_KEYS: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_sources(cls: type[_S], extra: Optional[Mapping[str, Any]] = None,
                     env: Optional[Mapping[str, str]] = None) -> _S:
        env = os.environ if env is None else env
        extra = {k: v for k, v in (extra or {}).items() if k not in cls._ENGINE_KEYS}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in extra if k not in fields)
        if unknown:
            raise invalid(f"{cls._WHERE}: unknown key(s) {unknown}; "
                          f"known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name in fields:
            if name in extra:
                values[name] = (f"{cls._WHERE}[{name!r}]", extra[name])
            elif cls._ENV_PREFIX and env.get(cls._ENV_PREFIX + name.upper()):
                values[name] = (cls._ENV_PREFIX + name.upper(),
                                env[cls._ENV_PREFIX + name.upper()])
        for name, var in (("access_id", "EMS_ACCESS_ID"), ("access_key", "EMS_ACCESS_KEY")):
            if name not in values and env.get(var) is not None:
                values[name] = (var, env[var])
        kwargs = {name: cls._convert(name, fields[name].type, where, raw)
                  for name, (where, raw) in values.items()}
        return cls(**kwargs)
    @staticmethod
    def _convert(name: str, kind: Any, where: str, raw: Any) -> Any:
        kind = str(kind)
        if raw is None and "Optional" in kind:
            return None
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower() if isinstance(raw, (str, int)) else ""
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise invalid(f"{where} must be true or false, got {raw!r}")
        if "int" in kind:
            try:
                value = int(raw)
            except (TypeError, ValueError):
                raise invalid(f"{where} must be an int, got {raw!r}") from None
            low = 0 if name == "min_load_tokens" else 1
            if value < low:
                raise invalid(f"{where} must be >= {low}, got {raw!r}")
            return value
        if "float" in kind:
            try:
                number = float(raw)
            except (TypeError, ValueError):
                raise invalid(f"{where} must be a number, got {raw!r}") from None
            if number < 0 or (name == "health_interval_s" and number <= 0):
                raise invalid(f"{where} must be > 0, got {raw!r}")
            return number
        if not isinstance(raw, str):
            raise invalid(f"{where} must be a string, got {type(raw).__name__}")
        if name == "pool" and raw.strip().lower() not in ("embedded", "server", "auto"):
            raise invalid(f"{where} must be embedded, server or auto, got {raw!r}")
        if name == "load_failure_policy" and raw not in ("recompute", "fail"):
            raise invalid(f"{where} must be recompute or fail, got {raw!r}")
        if name == "service" and not raw:
            raise invalid(f"{where} must not be empty")
        return raw

    def option(self, op: str, write_out: Optional[bool] = None) -> CcKvOption:
        """The ``CcKvOption`` of a ``load`` or a ``save``: its deadline, and a save's
        ``write_out`` (None: these settings'; a load writes nothing out)."""
        if op == "load":
            return CcKvOption(timeout=self.load_timeout_ms)
        return CcKvOption(timeout=self.save_timeout_ms,
                          write_out=self.write_out if write_out is None else write_out)

    def export_pool_env(self) -> None:
        """Hand ``pool`` / ``socket_dir`` to the SDK (which reads its environment)."""
        if self.pool is not None:
            os.environ["EMS_POOL"] = self.pool
        if self.socket_dir is not None:
            os.environ["EMS_SOCKET_DIR"] = self.socket_dir


@dataclasses.dataclass(frozen=True)
class ConnectorSettings(PoolSettings):
    """vLLM's ``EmsConnector``: what it may spend (see :class:`PoolSettings` for the rest)."""

    #: the model's identity in the pool's keys; None: vLLM's served model name
    model_id: Optional[str] = None
    #: the engine's service name: keys carry ``vllm@<service>``
    service: str = "default"
    #: a request that waits for KV blocks is asked about again every step; its
    #: pool answer is reused for this long instead of asking the pool each time
    lookup_reuse_ms: int = 1000
    #: a pool hit shorter than this is not loaded (0: any whole block)
    min_load_tokens: int = 0
    #: how often each role logs its counters (INFO); 0: never
    log_interval_s: float = 60.0
    #: vLLM's ``kv_load_failure_policy`` the connector sets when vLLM's default
    #: ("fail") is in place: a miss of a cache is recomputed, not an error
    load_failure_policy: str = "recompute"

    _ENV_PREFIX: ClassVar[str] = "EMS_VLLM_"
    _WHERE: ClassVar[str] = "kv_connector_extra_config"


@dataclasses.dataclass(frozen=True)
class StorageSettings(PoolSettings):
    """SGLang's ``EmsStorage`` (see :class:`PoolSettings` for the rest).

    SGLang hands the backend its own keys in the same mapping (``backend_name``,
    ``module_path``, ``class_name``, ``interface_v1``, and the prefetch knobs older
    versions leave in it): those pass; any other unknown key is refused."""

    #: the deadline of each load and each save of a batch of pages (both at once;
    #: None: ``load_timeout_ms`` / ``save_timeout_ms``)
    timeout_ms: Optional[int] = None
    #: the model's identity in the pool's keys; None: SGLang's model name
    model_id: Optional[str] = None
    #: run one small parallel torch op on each SGLang thread the first time it calls
    #: the backend, which puts a CPU engine in GNU OpenMP's throttled wait regime
    #: (:mod:`ems.integrations.openmp`); false: never (the regime stays as it was)
    openmp_warmup: bool = True

    _ENV_PREFIX: ClassVar[str] = "EMS_SGLANG_"
    _WHERE: ClassVar[str] = "hicache_storage_backend_extra_config"
    _ENGINE_KEYS: ClassVar[frozenset[str]] = frozenset({
        "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
        "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys"})

    def __post_init__(self) -> None:
        if self.timeout_ms is not None:
            # one knob for both deadlines (frozen: set through object.__setattr__)
            object.__setattr__(self, "load_timeout_ms", self.timeout_ms)
            object.__setattr__(self, "save_timeout_ms", self.timeout_ms)
