"""``EmsConnector``, the class vLLM loads (``kv_connector_module_path=
"ems.integrations.vllm"``): a thin façade, as vLLM's ``OffloadingConnector``. It reads
the engine's configuration (:func:`~ems.integrations.vllm.compat.engine_view`), opens
the pool session, builds the half of its role (the scheduler's or the worker's) and
hands each hook to it; a hook of the other role is a bug, caught by an assert.
Statistics, stats and shutdown are either role's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ems.config import CcConfig_v1, EmsConfig, KVCacheType
from ems.integrations.session import PoolSession
from ems.integrations.settings import ConnectorSettings
from ems.integrations.vllm.compat import EngineView, Ranks, engine_view, worker_ranks
from ems.integrations.vllm.half import CacheGroups, ConnectorHalf
from ems.integrations.vllm.scheduler import SchedulerHalf
from ems.integrations.vllm.stats import ConnectorStatistics, EmsConnectorStats
from ems.integrations.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["EmsConnector"]

logger = logging.getLogger(__name__)


class EmsConnector(KVConnectorBase_V1, SupportsHMA):
    """See the package docstring (:mod:`ems.integrations.vllm`)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_sources(ktc.kv_connector_extra_config or {})
        view = engine_view(vllm_config, kv_cache_config)
        self.block_size = view.block_size
        if view.block_size % view.hash_block_size:
            raise ValueError(f"EmsConnector: block_size {view.block_size} is not a "
                             f"multiple of the hash block size {view.hash_block_size}")
        groups = CacheGroups.of(view)
        if (role == KVConnectorRole.SCHEDULER and ktc.kv_load_failure_policy == "fail"
                and self.settings.load_failure_policy == "recompute"):
            # vLLM reads the policy after building the connector: a pool miss or a
            # failed load is recomputed, never a failed request.
            ktc.kv_load_failure_policy = "recompute"
        can_load, can_save = bool(ktc.is_kv_consumer), bool(ktc.is_kv_producer)
        ranks = worker_ranks() if role == KVConnectorRole.WORKER else Ranks()
        config = _pool_config(self.settings, view, groups, ranks)
        self._session = PoolSession.get(self.settings, config)
        if groups.unsupported:
            logger.warning("ems: EmsConnector disabled: %s", groups.unsupported)
        self.connector_scheduler: Optional[SchedulerHalf] = None
        self.connector_worker: Optional[WorkerHalf] = None
        self._half: ConnectorHalf
        if role == KVConnectorRole.SCHEDULER:
            self._half = self.connector_scheduler = SchedulerHalf(
                self.settings, groups, self._session, can_load, can_save,
                view.hash_block_size)
        else:
            self._half = self.connector_worker = WorkerHalf(
                self.settings, groups, self._session, can_load, can_save,
                skip_saves=groups.is_mla and ranks.tp_rank != 0)
        v1 = config.cc_config_v1
        assert v1 is not None
        logger.info("ems: EmsConnector (%s) for %s, block_size %d, keys of %s",
                    role.name.lower(), v1.model_id, self.block_size, v1.llm_engine)

    @property
    def scheduler(self) -> SchedulerHalf:
        assert self.connector_scheduler is not None, "a scheduler hook on a worker"
        return self.connector_scheduler

    @property
    def worker(self) -> WorkerHalf:
        assert self.connector_worker is not None, "a worker hook on the scheduler"
        return self.connector_worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[Optional[int], bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput"
                             ) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.scheduler.request_finished_all_groups(request, block_ids)

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer (one pool object per block)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save saves every layer of a block at once

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self.worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # ------------------------------------------------------------ either role
    def flush(self) -> None:
        """Wait for every save submitted so far (each bounded by ``save_timeout_ms``)."""
        self._half.flush()

    def shutdown(self) -> None:
        self._half.shutdown()

    def statistics(self) -> ConnectorStatistics:
        """This connector's cumulative counters (pool failures included)."""
        return self._half.statistics()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        return self._half.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None
                                 ) -> Optional[KVConnectorStats]:
        return EmsConnectorStats(data=dict(data or {}))


def _pool_config(settings: ConnectorSettings, view: EngineView, groups: CacheGroups,
                 ranks: Ranks) -> EmsConfig:
    """The SDK's configuration: TP and PP ranks keep separate keys, MLA's TP ranks
    share theirs."""
    v1 = CcConfig_v1(rank_id=ranks.rank, device_id=ranks.device,
                     model_id=settings.model_id or view.model_name,
                     tp_world_size=view.tp_world_size, pp_world_size=view.pp_world_size,
                     rank_in_tp_group=ranks.tp_rank, rank_in_pp_group=ranks.pp_rank,
                     llm_engine=f"vllm@{settings.service}")
    if groups.is_mla:
        v1.kvcache_type = KVCacheType.MLA
    return EmsConfig(access_id=settings.access_id, access_key=settings.access_key,
                     cc_config_v1=v1)
