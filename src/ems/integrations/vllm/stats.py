"""The connector's counters: :class:`ConnectorStatistics` (``EmsConnector.statistics()``)
and :class:`EmsConnectorStats`, vLLM's connector-stats hook over the same counters."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["ConnectorStatistics", "EmsConnectorStats"]


@dataclasses.dataclass(frozen=True)
class ConnectorStatistics:
    """Cumulative counters of one connector (role); ``statistics()`` returns one."""

    lookups: int = 0
    tokens_looked_up: int = 0
    tokens_hit: int = 0
    tokens_loaded: int = 0
    tokens_load_failed: int = 0
    tokens_saved: int = 0
    tokens_save_failed: int = 0
    lookup_s: float = 0.0  # the scheduler's lookups (on the request's critical path)
    load_s: float = 0.0  # the worker's loads (the forward waits for them)
    save_s: float = 0.0  # the saves (beside the engine, on the save thread)
    hooks_s: float = 0.0  # the engine's threads inside this connector's hooks
    failures: int = 0  # pool failures (a call that got no cache)
    key_collisions: int = 0  # loaded blocks whose identity was another prefix's (a miss)


_COUNTERS = tuple(f.name for f in dataclasses.fields(ConnectorStatistics))


class EmsConnectorStats(KVConnectorStats):
    """vLLM's connector stats hook: the counters of one interval, summed over ranks."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> "EmsConnectorStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = {k: self.data.get(k, 0) for k in _COUNTERS}
        looked = d["tokens_looked_up"]
        d["hit_rate"] = round(d["tokens_hit"] / looked, 4) if looked else 0.0
        return d

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _COUNTERS)
