"""What the connector's two halves share: the engine's KV cache groups as ems serves
them (:class:`CacheGroups`), and :class:`ConnectorHalf`, the base of the scheduler's
half and the worker's (settings, pool session, counters, the periodic log).

``@_timed`` marks the hooks whose time counts as ``hooks_s``: the connector's share of
the engine's critical path (the saves themselves run beside it, on the save thread).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Optional, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ems.integrations.counters import Counters
from ems.integrations.kv_layout import group_kind, is_mla
from ems.integrations.session import PoolSession
from ems.integrations.settings import ConnectorSettings
from ems.integrations.vllm.compat import EngineView
from ems.integrations.vllm.stats import ConnectorStatistics, EmsConnectorStats

__all__ = ["CacheGroups", "ConnectorHalf"]

logger = logging.getLogger(__name__)

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _timed(hook: _Hook) -> _Hook:
    """Count the time the engine spends in ``hook`` (``hooks_s``)."""
    @functools.wraps(hook)
    def timed(self: "ConnectorHalf", *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._counters.add(hooks_s=time.perf_counter() - t0)
    return timed  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class CacheGroups:
    """The engine's KV cache groups (hybrid models have several; one pool object per
    block holds every group's pages of it, see :mod:`ems.integrations.kv_layout`)."""

    block_size: int
    specs: list[Any]  # per group, vLLM's KV cache spec
    layers: list[list[str]]  # per group, its layers' names
    kinds: list[Optional[str]]  # per group, its kind (kv_layout.group_kind)
    on_cpu: bool  # vLLM's CPU backend
    #: why this engine's KV cache cannot be served ("" when it can)
    unsupported: str
    #: every group is MLA: all TP ranks share the keys, only TP rank 0 saves
    is_mla: bool
    #: several groups: vLLM takes load failures per request only (block ids are per
    #: group), so loads are asynchronous and a failure recomputes the request
    hybrid: bool
    #: a windowed group: its blocks may be reused once out of the window, so a save
    #: copies them before the step ends (see the worker's wait_for_save)
    windowed: bool
    #: the group whose block ids carry the identity pages: a full-attention one (its
    #: blocks are never vLLM's null block)
    ident_group: int

    @classmethod
    def of(cls, view: EngineView) -> "CacheGroups":
        specs, layers = view.specs, view.group_layers
        kinds = [group_kind(spec) for spec in specs]
        return cls(block_size=view.block_size, specs=specs, layers=layers, kinds=kinds,
                   on_cpu=view.on_cpu,
                   unsupported=_unsupported(specs, kinds, view.block_size),
                   is_mla=bool(specs) and all(is_mla(spec) for spec in specs),
                   hybrid=len(specs) > 1,
                   windowed=any(kind == "window" for kind in kinds),
                   ident_group=kinds.index("full") if "full" in kinds else 0)

    def layer_groups(self) -> Optional[list[list[int]]]:
        """The SDK's layer groups: registered layers are ordered group by group, the
        identity pages last in their group."""
        if not self.hybrid:
            return None
        out, i = [], 0
        for g, names in enumerate(self.layers):
            n = len(names) + (g == self.ident_group)
            out.append(list(range(i, i + n)))
            i += n
        return out


def _unsupported(specs: list[Any], kinds: list[Optional[str]], block_size: int) -> str:
    """Why this engine's KV cache cannot be served ("" when it can)."""
    if not specs:
        return "no KV cache groups"
    for g, (spec, kind) in enumerate(zip(specs, kinds)):
        if kind is None:
            return (f"KV cache group {g} is {type(spec).__name__} (served: full "
                    f"attention, sliding window, chunked local attention)")
        if spec.block_size != block_size:
            return (f"KV cache group {g} has block_size {spec.block_size}, not the "
                    f"engine's {block_size}")
    return ""


class ConnectorHalf:
    """The base of the connector's halves: one per role, built by ``EmsConnector``."""

    role_name = ""  # "scheduler" or "worker" (the periodic log's)

    def __init__(self, settings: ConnectorSettings, groups: CacheGroups,
                 session: PoolSession, can_load: bool, can_save: bool) -> None:
        self.settings = settings
        self.groups = groups
        self.block_size = groups.block_size
        self._session = session
        # kv_role: "kv_both" loads and saves; "kv_consumer" only loads, "kv_producer"
        # only saves.
        self._can_load = can_load
        self._can_save = can_save
        self._counters = Counters(ConnectorStatistics)
        self._last_log = time.monotonic()
        self._disabled = groups.unsupported

    def flush(self) -> None:
        """Wait for every save submitted so far (none but the worker's)."""

    def shutdown(self) -> None:
        self.flush()
        self._maybe_log(force=True)
        self._session.close()

    def statistics(self) -> ConnectorStatistics:
        """This half's cumulative counters (pool failures included)."""
        snap = self._counters.snapshot()
        return dataclasses.replace(snap, failures=self._session.failures)

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        data = self._counters.interval()
        return EmsConnectorStats(data=data) if data else None

    def _maybe_log(self, force: bool = False) -> None:
        every = self.settings.log_interval_s
        now = time.monotonic()
        if not force and (every <= 0 or now - self._last_log < every):
            return
        self._last_log = now
        s = self.statistics()
        logger.info("ems: %s: %d lookups, tokens looked up %d / hit %d / loaded %d "
                    "(failed %d) / saved %d (failed %d), lookup %.3f s, load %.3f s, "
                    "save %.3f s, in hooks %.3f s, pool %s, %d failures", self.role_name,
                    s.lookups, s.tokens_looked_up, s.tokens_hit, s.tokens_loaded,
                    s.tokens_load_failed, s.tokens_saved, s.tokens_save_failed,
                    s.lookup_s, s.load_s, s.save_s, s.hooks_s, self._session.state.value,
                    s.failures)
