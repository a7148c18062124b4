"""Settings of the ems KV connector: ``kv_connector_extra_config`` first, then the
``EMS_VLLM_*`` environment, then the defaults below.

Every field has a default, a unit in its name and a rule; an unknown key or a bad
value raises ``EMS_INVALID_ARGUMENT`` naming the key (fail closed: a typo in a
deadline must not silently keep the default). Where the pool is (``EMS_POOL``,
``EMS_SOCKET_DIR``, ``EMS_CONNECT_TIMEOUT_MS``) is the SDK's own environment; the
connector's ``pool`` / ``socket_dir`` keys, when given, are exported to it before
``Ems.init``. Credentials: ``access_id`` / ``access_key`` keys or ``EMS_ACCESS_ID`` /
``EMS_ACCESS_KEY``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from ems.errors import invalid

__all__ = ["ConnectorSettings"]


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """What the connector may spend and whom it talks to."""

    #: ``embedded`` | ``server`` | ``auto`` (exported as EMS_POOL); None: the environment's
    pool: Optional[str] = None
    #: the daemon's socket directory (exported as EMS_SOCKET_DIR); None: the environment's
    socket_dir: Optional[str] = None
    access_id: Optional[str] = None
    access_key: Optional[str] = None
    #: the model's identity in the pool's keys; None: vLLM's served model name
    model_id: Optional[str] = None
    #: the engine's service name: keys carry ``vllm@<service>``
    service: str = "default"
    #: deadline of the scheduler's lookup (``exists``) of one request; past it the
    #: request is served without the cache. A lookup answers in ~0.1 ms on a local
    #: daemon; 200 ms only ever passes when the pool hangs.
    lookup_timeout_ms: int = 200
    #: a request that waits for KV blocks is asked about again every step; its
    #: pool answer is reused for this long instead of asking the pool each time
    lookup_reuse_ms: int = 1000
    #: deadline of one step's loads (the forward waits for them)
    load_timeout_ms: int = 5000
    #: deadline of one save (runs beside the engine; its blocks stay held meanwhile)
    save_timeout_ms: int = 10000
    #: a pool hit shorter than this is not loaded (0: any whole block)
    min_load_tokens: int = 0
    #: how often a down pool is probed (``Ems.check_health``), and an up one checked
    health_interval_s: float = 10.0
    #: how often each role logs its counters (INFO); 0: never
    log_interval_s: float = 60.0
    #: vLLM's ``kv_load_failure_policy`` the connector sets when vLLM's default
    #: ("fail") is in place: a miss of a cache is recomputed, not an error
    load_failure_policy: str = "recompute"

    _ENV_PREFIX = "EMS_VLLM_"

    @classmethod
    def from_sources(cls, extra: Optional[Mapping[str, Any]] = None,
                     env: Optional[Mapping[str, str]] = None) -> "ConnectorSettings":
        env = os.environ if env is None else env
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in extra if k not in fields)
        if unknown:
            raise invalid(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                          f"known: {sorted(fields)}")
        values: dict[str, Any] = {}
        for name in fields:
            if name in extra:
                values[name] = (f"kv_connector_extra_config[{name!r}]", extra[name])
            elif env.get(cls._ENV_PREFIX + name.upper()):
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
        if "int" in kind and "Optional" not in kind:
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

    def export_pool_env(self) -> None:
        """Hand ``pool`` / ``socket_dir`` to the SDK (which reads its environment)."""
        if self.pool is not None:
            os.environ["EMS_POOL"] = self.pool
        if self.socket_dir is not None:
            os.environ["EMS_SOCKET_DIR"] = self.socket_dir
