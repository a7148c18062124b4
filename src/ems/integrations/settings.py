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

Each field is declared once (``ems.settings``): its key, its ``{prefix}`` variable,
its parser; the merge, the refusal of unknown keys and the settings tables of
docs/vllm.md and docs/sglang.md are made from the declarations.

* :class:`PoolSettings` -- what every integration's pool session needs.
* :class:`ConnectorSettings` -- vLLM's KV connector.
* :class:`StorageSettings` -- SGLang's HiCache storage backend.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar, Mapping, Optional, TypeVar

from ems.config import CcKvOption
from ems.settings import Boolean, Choice, Integer, Layer, Number, Text, check_fields, load, setting

__all__ = ["ConnectorSettings", "PoolSettings", "StorageSettings"]

_S = TypeVar("_S", bound="PoolSettings")
#: the integration's own variable: ``EMS_VLLM_`` / ``EMS_SGLANG_`` + the upper-case key
_OWN = "{prefix}"


def _own(name: str, *more: str) -> tuple[str, ...]:
    return (_OWN + name.upper(), *more)


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """Whom the integration talks to, and the deadlines of its pool session."""

    pool: Optional[str] = setting(
        "embedded, server or auto (exported as EMS_POOL); unset: the environment's",
        Choice(("embedded", "server", "auto"), fold="lower"), default=None,
        env=_own("pool"), shown="EMS_POOL")
    socket_dir: Optional[str] = setting(
        "the daemon's socket directory (exported as EMS_SOCKET_DIR); unset: the "
        "environment's", Text(), default=None, env=_own("socket_dir"),
        shown="EMS_SOCKET_DIR")
    access_id: Optional[str] = setting("the tenant's access_id", Text(empty=True),
                                       default=None, env=_own("access_id", "EMS_ACCESS_ID"))
    access_key: Optional[str] = setting("its access_key (empty: anonymous)", Text(empty=True),
                                        default=None, repr=False,
                                        env=_own("access_key", "EMS_ACCESS_KEY"))
    #: A lookup answers in ~0.1 ms on a local daemon; 200 ms only ever passes when
    #: the pool hangs.
    lookup_timeout_ms: int = setting(
        "deadline of one lookup (exists); past it the lookup answers no cache", Integer(1),
        default=200, env=_own("lookup_timeout_ms"))
    load_timeout_ms: int = setting("deadline of one load (the engine waits for it)",
                                   Integer(1), default=5000, env=_own("load_timeout_ms"))
    save_timeout_ms: int = setting("deadline of one save", Integer(1), default=10000,
                                   env=_own("save_timeout_ms"))
    health_interval_s: float = setting(
        "how often a down pool is probed (Ems.check_health), and an up one checked",
        Number(0, open_low=True), default=10.0, env=_own("health_interval_s"))
    write_out: bool = setting(
        "the saves' CcKvOption.write_out: false keeps them in the pool's shared memory "
        "only (no disk or cluster tier writes them out); vLLM takes a request's "
        "kv_transfer_params ems_write_out over it", Boolean(), default=True,
        env=_own("write_out"))

    #: the environment's prefix of these fields (``EMS_VLLM_`` + the upper-case name)
    _ENV_PREFIX: ClassVar[str] = ""
    #: what the engine calls the mapping these settings come from (for messages)
    _WHERE: ClassVar[str] = "extra_config"
    #: the engine's own keys in that mapping: passed over, never refused
    _ENGINE_KEYS: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_sources(cls: type[_S], extra: Optional[Mapping[str, Any]] = None,
                     env: Optional[Mapping[str, str]] = None) -> _S:
        """Defaults < the environment < the engine's extra config."""
        return load(cls, [Layer.environ(os.environ if env is None else env, cls._ENV_PREFIX),
                          Layer.table(extra or {}, cls._WHERE, cls._ENGINE_KEYS,
                                      quoted=True)])

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

    model_id: Optional[str] = setting(
        "the model's identity in the pool's keys", Text(), default=None,
        shown="vLLM's served model name", env=_own("model_id"))
    service: str = setting("the engine's service name: keys carry vllm@<service>", Text(),
                           default="default", env=_own("service"))
    #: a request that waits for KV blocks is asked about again every step
    lookup_reuse_ms: int = setting(
        "a waiting request's pool answer is reused this long instead of asking again",
        Integer(1), default=1000, env=_own("lookup_reuse_ms"))
    min_load_tokens: int = setting("a pool hit shorter than this is not loaded (0: any "
                                   "whole block)", Integer(0), default=0,
                                   env=_own("min_load_tokens"))
    log_interval_s: float = setting("how often each role logs its counters (INFO); 0: "
                                    "never", Number(0), default=60.0,
                                    env=_own("log_interval_s"))
    load_failure_policy: str = setting(
        "vLLM's kv_load_failure_policy set where vLLM's default (fail) is in place: a "
        "miss of a cache is recomputed, not an error", Choice(("recompute", "fail")),
        default="recompute", env=_own("load_failure_policy"))

    _ENV_PREFIX: ClassVar[str] = "EMS_VLLM_"
    _WHERE: ClassVar[str] = "kv_connector_extra_config"


@dataclasses.dataclass(frozen=True)
class StorageSettings(PoolSettings):
    """SGLang's ``EmsStorage`` (see :class:`PoolSettings` for the rest).

    SGLang hands the backend its own keys in the same mapping (``backend_name``,
    ``module_path``, ``class_name``, ``interface_v1``, and the prefetch knobs older
    versions leave in it): those pass; any other unknown key is refused."""

    timeout_ms: Optional[int] = setting(
        "the deadline of each load and each save of a batch of pages (both at once)",
        Integer(1), default=None, shown="load_timeout_ms / save_timeout_ms",
        env=_own("timeout_ms"))
    model_id: Optional[str] = setting("the model's identity in the pool's keys", Text(),
                                      default=None, shown="SGLang's model name",
                                      env=_own("model_id"))
    openmp_warmup: bool = setting(
        "run one small parallel torch op on each SGLang thread the first time it calls "
        "the backend (GNU OpenMP's throttled wait regime: ems.integrations.openmp); "
        "false: never", Boolean(), default=True, env=_own("openmp_warmup"))

    _ENV_PREFIX: ClassVar[str] = "EMS_SGLANG_"
    _WHERE: ClassVar[str] = "hicache_storage_backend_extra_config"
    _ENGINE_KEYS: ClassVar[frozenset[str]] = frozenset({
        "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
        "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.timeout_ms is not None:
            # one knob for both deadlines (frozen: set through object.__setattr__)
            object.__setattr__(self, "load_timeout_ms", self.timeout_ms)
            object.__setattr__(self, "save_timeout_ms", self.timeout_ms)
