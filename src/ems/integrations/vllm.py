"""``EmsConnector``: the ems pool as the KV-cache tier of a vLLM engine (KV connector v1).

    --kv-transfer-config '{"kv_connector": "EmsConnector",
                           "kv_connector_module_path": "ems.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"pool": "server"}}'

vLLM makes two instances: the SCHEDULER role (the engine-core process, no KV tensors)
and the WORKER role (one per rank). They share only the metadata the scheduler builds
each step (:class:`EmsConnectorMetadata`) and what the worker reports back.

A request's life, as the connector sees it::

    scheduler                                   worker (same step)
    get_num_new_matched_tokens  -- exists(leading full prompt blocks) within
        |                          lookup_timeout_ms; never the last prompt token
    update_state_after_alloc    -- remember the hit (local blocks + pool blocks)
    build_connector_meta        -- loads: pool blocks -> their allocated block ids
        |                          saves: full prompt blocks computed by this step
        |                          (every chunk of a chunked prefill)
        +------ metadata ------> handle_preemptions: wait for saves of preempted reqs
                                 start_load_kv: load, wait (SDK deadline); a miss or a
                                                failure -> get_block_ids_with_load_errors
                                                -> vLLM recomputes those tokens
                                 (forward)
                                 wait_for_save: submit the step's saves, return at once
    request_finished            -- True when saves were planned: vLLM keeps the blocks
        |                          until the worker reports the request in
        +<-- finished_sending -- get_finished, once every save of it is done

Block keys (:mod:`ems.integrations.block_keys`): ems's own prefix chain of sha256
over each block's tokens and vLLM's extra keys (LoRA, multimodal hashes, cache salt),
never vLLM's block hashes, which depend on ``PYTHONHASHSEED`` and on
``prefix_caching_hash_algo`` (random per process for xxhash): the same tokens give the
same keys in every engine, process, restart and host. The scheduler computes them and
sends them in the metadata, so the worker uses the very same numbers. A key is 64
bits; the block's whole 32-byte digest travels with it in the pool object (an
identity page, registered as one more layer) and is compared after every load: a
collision is a miss, recomputed, never the wrong KV.

Hybrid models (``SupportsHMA``, vLLM's hybrid KV cache manager): each KV cache group's
layers are an SDK layer group with its own block ids, one pool object per block holds
every group's pages of it (a hit is the minimum over groups, a restore never partial),
loads are asynchronous (vLLM maps their failures to requests), and saves of
sliding-window blocks are copied before the step ends: see :mod:`ems.integrations.kv_layout`
and docs/vllm-hybrid.md. Saves carry vLLM's own block hashes (``event_hashes``), which a
daemon with ``--kv-events`` publishes (docs/kv-events.md).

Layouts (``register_kv_caches``): vLLM's CPU pages (0.32 hands them over as
``[num_blocks, kv_heads, block_size, 2*head_size]``, the attention views the same
storage as ``[num_blocks, kv_heads, 2*block_size, head_size]``: a block's K rows then
its V rows, per head) are viewed as the latter and registered as opaque pages of
``block_size`` tokens; split K/V layouts (``[2, num_blocks, block_size, heads,
head]``) as two paged tensors per layer; MLA ``[num_blocks, block_size, dim]`` as
one. Only whole blocks ever move. The pool object of a block holds every layer of this
rank, so loads and saves happen once per step, not per layer. TP and PP ranks keep
separate keys (the SDK's ``CcConfig_v1``); with MLA all TP ranks share them and only
TP rank 0 saves.

The pool down, slow, full or refusing: see :mod:`ems.integrations.session`; every hook
returns within its deadline and the engine serves without the cache meanwhile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ems.client import cuda
from ems.config import CcConfig_v1, EmsConfig, KVCacheType
from ems.errors import EmsException
from ems.integrations.block_keys import ROOT, block_digest, event_hash, key_of
from ems.integrations.counters import Counters
from ems.integrations.kv_layout import (
    NULL_BLOCK,
    canonical_layer,
    chunk_descs,
    group_kind,
    identity_shape,
    is_mla,
    leading_identities,
    mirror_shapes,
    write_identities,
)
from ems.integrations.session import PoolSession, request_write_out
from ems.integrations.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorStatistics", "EmsConnector", "EmsConnectorMetadata",
           "EmsConnectorStats"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- metadata
@dataclasses.dataclass
class BlockTransfer:
    """Blocks of one request to move: per KV cache group, the engine's block ids of
    these blocks (``block_ids[g][i]``: block ``i`` in group ``g``), and their keys."""

    req_id: str
    block_ids: list[list[int]]
    hashes: list[int]
    #: each block's identity (its 32-byte digest), checked after a load
    identities: list[bytes] = dataclasses.field(default_factory=list)
    #: a save's vLLM block hashes as vLLM publishes them in its KV events (the pool's
    #: KV events carry them; empty: not known)
    event_hashes: list[int] = dataclasses.field(default_factory=list)
    #: an asynchronous load (hybrid models): reported in finished_recving, and a
    #: failure in failed_recving (the whole request is recomputed)
    is_async: bool = False
    #: a save's ``CcKvOption.write_out`` (the request's ``ems_write_out``)
    write_out: bool = True


@dataclasses.dataclass
class EmsConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------- statistics
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


# ---------------------------------------------------------------- scheduler state
@dataclasses.dataclass
class _Plan:
    """The scheduler's view of one request."""

    request: Any
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)  # per group
    hashes: list[int] = dataclasses.field(default_factory=list)  # pool keys
    digests: list[bytes] = dataclasses.field(default_factory=list)  # their identities
    mm_index: int = 0  # vLLM's multimodal index after the last block hashed
    keyless: bool = False  # an extra key without a canonical form: never cached
    local_blocks: int = 0  # leading blocks vLLM had (its prefix cache)
    load_blocks: int = 0  # blocks after those to load from the pool (0: none)
    load_planned: bool = False
    saved_upto: int = -1  # blocks [0, saved_upto) need no save; -1: not set yet
    has_saves: bool = False
    write_out: Optional[bool] = None  # its saves' write_out; None: not read yet


def _timed(hook: Any) -> Any:
    """Count the time the engine spends in ``hook`` (``hooks_s``: the connector's share of
    the engine's critical path; the saves themselves run beside it)."""
    @functools.wraps(hook)
    def timed(self: "EmsConnector", *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._counters.add(hooks_s=time.perf_counter() - t0)
    return timed


class EmsConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_sources(ktc.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        hbs = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        if self.block_size % hbs:
            raise ValueError(f"EmsConnector: block_size {self.block_size} is not a "
                             f"multiple of the hash block size {hbs}")
        self._hash_stride = self.block_size // hbs
        self._counters = Counters(ConnectorStatistics)
        self._last_log = time.monotonic()
        self._disabled = ""
        groups = kv_cache_config.kv_cache_groups if kv_cache_config else []
        from vllm.platforms import current_platform
        self._on_cpu = current_platform.is_cpu()
        # Per KV cache group: its spec and its layers (hybrid models have several; one
        # pool object per block holds every group's pages of it, see kv_layout).
        self._specs: list[Any] = [g.kv_cache_spec for g in groups]
        self._group_layers: list[list[str]] = [list(g.layer_names) for g in groups]
        self._kinds = [group_kind(spec) for spec in self._specs]
        self._disabled = self._unsupported(groups)
        self._num_layers = sum(len(names) for names in self._group_layers)
        self._is_mla = bool(self._specs) and all(is_mla(spec) for spec in self._specs)
        # Several groups: vLLM takes load failures per request only (block ids are
        # per group), so loads are asynchronous and a failure recomputes the request;
        # a windowed group's blocks may be reused once out of the window, so a save
        # copies them before the step ends (see wait_for_save).
        self._hybrid = len(groups) > 1
        self._windowed = any(kind == "window" for kind in self._kinds)
        # the group whose block ids carry the identity pages: a full-attention one
        # (its blocks are never vLLM's null block)
        self._ident_group = self._kinds.index("full") if "full" in self._kinds else 0
        self._ident: Optional[torch.Tensor] = None  # the worker's identity pages
        # the engine's CUDA device (set by register_kv_caches; None: CPU)
        self._cuda_device: Optional[torch.device] = None
        if (role == KVConnectorRole.SCHEDULER and ktc.kv_load_failure_policy == "fail"
                and self.settings.load_failure_policy == "recompute"):
            # vLLM reads the policy after building the connector: a pool miss or a
            # failed load is recomputed, never a failed request.
            ktc.kv_load_failure_policy = "recompute"
        # kv_role: "kv_both" loads and saves; "kv_consumer" only loads, "kv_producer"
        # only saves.
        self._can_load = bool(ktc.is_kv_consumer)
        self._can_save = bool(ktc.is_kv_producer)
        self._tp_rank = 0
        config = self._ems_config(vllm_config, role)
        self._session = PoolSession.get(self.settings, config)
        # scheduler
        self._plans: dict[str, _Plan] = {}
        # req_id -> (local blocks, pool hits, when asked)
        self._lookups: dict[str, tuple[int, int, float]] = {}
        self._async_loads: list[str] = []  # allocated, to load in the next step
        # worker
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()  # asynchronous loads done (finished_recving)
        self._load_failed: set[str] = set()  # ... that failed (failed_recving)
        self._saves: dict[str, list[Future]] = {}
        self._finishing: set[str] = set()
        self._skip_saves = False
        if self._disabled:
            logger.warning("ems: EmsConnector disabled: %s", self._disabled)
        elif role == KVConnectorRole.SCHEDULER:
            self._register_mirror()
        v1 = config.cc_config_v1
        assert v1 is not None
        logger.info("ems: EmsConnector (%s) for %s, block_size %d, keys of %s",
                    role.name.lower(), v1.model_id, self.block_size, v1.llm_engine)

    # ------------------------------------------------------------ setup
    def _unsupported(self, groups: list[Any]) -> str:
        """Why this engine's KV cache cannot be served ("" when it can)."""
        if not groups:
            return "no KV cache groups"
        for g, (spec, kind) in enumerate(zip(self._specs, self._kinds)):
            if kind is None:
                return (f"KV cache group {g} is {type(spec).__name__} (served: full "
                        f"attention, sliding window, chunked local attention)")
            if spec.block_size != self.block_size:
                return (f"KV cache group {g} has block_size {spec.block_size}, not the "
                        f"engine's {self.block_size}")
        return ""

    def _ems_config(self, vllm_config: "VllmConfig", role: KVConnectorRole) -> EmsConfig:
        par = vllm_config.parallel_config
        tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
        rank = device = tp_rank = pp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed import parallel_state as ps
            try:
                tp_rank = ps.get_tensor_model_parallel_rank()
                pp_rank = ps.get_pp_group().rank_in_group
                rank = ps.get_world_group().rank
                device = ps.get_world_group().local_rank
            except (AssertionError, AttributeError):  # no process groups: one rank
                pass
        self._tp_rank = tp_rank
        self._skip_saves = self._is_mla and tp_rank != 0
        model = self.settings.model_id or vllm_config.model_config.served_model_name
        if isinstance(model, (list, tuple)):
            model = model[0]
        v1 = CcConfig_v1(rank_id=rank, device_id=device, model_id=str(model),
                         tp_world_size=tp, pp_world_size=pp, rank_in_tp_group=tp_rank,
                         rank_in_pp_group=pp_rank, llm_engine=f"vllm@{self.settings.service}")
        if self._is_mla:
            v1.kvcache_type = KVCacheType.MLA
        return EmsConfig(access_id=self.settings.access_id,
                         access_key=self.settings.access_key, cc_config_v1=v1)

    def _layer_groups(self) -> Optional[list[list[int]]]:
        """The SDK's layer groups: registered layers are ordered group by group, the
        identity pages last in their group."""
        if not self._hybrid:
            return None
        out, i = [], 0
        for g, names in enumerate(self._group_layers):
            n = len(names) + (g == self._ident_group)
            out.append(list(range(i, i + n)))
            i += n
        return out

    def _register_mirror(self) -> None:
        layers: list[list[torch.Tensor]] = []
        page = None
        for g, (spec, names) in enumerate(zip(self._specs, self._group_layers)):
            shapes, page, _ = mirror_shapes(spec, self.block_size, self._on_cpu)
            for _ in names:
                layers.append([torch.empty((1, *s), dtype=spec.dtype, device="meta")
                               for s in shapes])
            if g == self._ident_group:
                layers.append([torch.empty((1, *identity_shape(self.block_size)),
                                           dtype=torch.uint8, device="meta")])
        self._session.register(layers, page, real=False, groups=self._layer_groups())

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._disabled:
            return
        layers: list[list[torch.Tensor]] = []
        page = None
        for g, (spec, names) in enumerate(zip(self._specs, self._group_layers)):
            want, want_page, _ = mirror_shapes(spec, self.block_size, self._on_cpu)
            for name in names:
                kv = kv_caches.get(name)
                if kv is None:
                    self._disable(f"vLLM registered no KV cache for layer {name!r} "
                                  f"(group {g})")
                    return
                try:
                    tensors, page = canonical_layer(kv, self.block_size, spec, self._on_cpu)
                except ValueError as exc:
                    self._disable(f"layer {name!r}: {exc}")
                    return
                got = [tuple(t.shape[1:]) for t in tensors]
                if got != want or page != want_page or tensors[0].dtype != spec.dtype:
                    self._disable(f"the worker's layout of {name!r} {got} "
                                  f"({tensors[0].dtype}) is not the one the scheduler looks "
                                  f"up ({want}, {spec.dtype})")
                    return
                layers.append(tensors)
            if g == self._ident_group:
                num_blocks = layers[-1][0].shape[0]
                self._ident = torch.zeros((num_blocks, *identity_shape(self.block_size)),
                                          dtype=torch.uint8, device=layers[-1][0].device)
                layers.append([self._ident])
        first = layers[0][0]
        self._cuda_device = first.device if first.device.type == "cuda" else None
        self._session.register(layers, page, real=True, groups=self._layer_groups())
        logger.info("ems: registered %d layers in %d KV cache group(s) (%s) of %s pages",
                    len(layers), len(self._specs), ", ".join(map(str, self._kinds)),
                    "opaque" if page else "paged")

    def _disable(self, why: str) -> None:
        self._disabled = why
        logger.warning("ems: EmsConnector disabled: %s", why)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # ------------------------------------------------------------ scheduler side
    def _hashes(self, plan: _Plan, n_blocks: int) -> list[int]:
        """The pool keys of the request's first ``n_blocks`` blocks (fewer when its
        tokens stop before, or a block has an extra key without a canonical form)."""
        have = len(plan.hashes)
        if have < n_blocks and not plan.keyless:
            from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
            request, bs = plan.request, self.block_size
            tokens = request.all_token_ids
            parent = plan.digests[-1] if plan.digests else ROOT
            for i in range(have, min(n_blocks, len(tokens) // bs)):
                extra, plan.mm_index = generate_block_hash_extra_keys(
                    request, i * bs, (i + 1) * bs, plan.mm_index)
                try:
                    parent = block_digest(parent, tokens[i * bs:(i + 1) * bs], extra)
                except TypeError as exc:
                    plan.keyless = True
                    logger.warning("ems: request %s is not cached: %s", request.request_id,
                                   exc)
                    break
                plan.digests.append(parent)
                plan.hashes.append(key_of(parent))
        return plan.hashes[:n_blocks]

    def _event_hashes(self, plan: _Plan, a: int, b: int) -> list[int]:
        """vLLM's own hashes of blocks ``[a, b)`` as it publishes them in KV events (a
        block's: the hash of its last hash block), or [] when it has not them all."""
        bh, s = plan.request.block_hashes, self._hash_stride
        if len(bh) < b * s:
            return []
        return [event_hash(bh[(i + 1) * s - 1]) for i in range(a, b)]

    @_timed  # hooks_s
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[Optional[int], bool]:
        """Leading whole blocks after vLLM's own hit that the pool holds. A pool object
        holds every KV cache group's pages of its block, so a hit has every group
        (the minimum over groups is the object count); a hybrid model loads them
        asynchronously (see ``__init__``)."""
        prompt = request.prompt_token_ids
        if self._disabled or not prompt:
            return 0, False
        bs = self.block_size
        last = (len(prompt) - 1) // bs  # full blocks before the last prompt token
        first = num_computed_tokens // bs
        plan = self._plans.setdefault(request.request_id, _Plan(request))
        now = time.monotonic()
        prev = self._lookups.get(request.request_id)
        if prev is not None and prev[0] == first and \
                now - prev[2] < self.settings.lookup_reuse_ms / 1000.0:
            # asked again while waiting for blocks
            return prev[1] * bs, self._hybrid and prev[1] > 0
        hits = 0
        if (self._can_load and last > first
                and not getattr(request, "skip_reading_prefix_cache", False)):
            t0 = time.perf_counter()
            hashes = self._hashes(plan, last)[first:]
            hits = self._session.lookup(hashes, [bs] * len(hashes)) if hashes else 0
            if hits * bs < max(self.settings.min_load_tokens, 1):
                hits = 0
            self._counters.add(lookups=1, tokens_looked_up=len(hashes) * bs,
                               tokens_hit=hits * bs, lookup_s=time.perf_counter() - t0)
        # vLLM's own cache had ``first`` blocks: they need no save either
        self._lookups[request.request_id] = (first, hits, now)
        return hits * bs, self._hybrid and hits > 0

    @_timed  # hooks_s
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        plan = self._plans.setdefault(request.request_id, _Plan(request))
        first, hits, _ = self._lookups.pop(
            request.request_id, (request.num_computed_tokens // self.block_size, 0, 0.0))
        n_load = num_external_tokens // self.block_size
        plan.local_blocks = first
        plan.load_blocks = min(n_load, hits) if num_external_tokens else 0
        plan.load_planned = plan.load_blocks > 0
        plan.saved_upto = max(plan.saved_upto, first + plan.load_blocks)
        if plan.load_planned and self._hybrid:
            # An asynchronous load: the request waits (not scheduled) until the
            # worker reports it; its blocks are these, in every group.
            plan.block_ids = [list(ids) for ids in blocks.get_block_ids()]
            self._async_loads.append(request.request_id)

    @_timed  # hooks_s
    def build_connector_meta(self, scheduler_output: "SchedulerOutput"
                             ) -> KVConnectorMetadata:
        meta = EmsConnectorMetadata()
        if self._disabled:
            return meta
        for req_id in self._async_loads:
            plan = self._plans.get(req_id)
            if plan is not None:
                self._plan_load(plan, req_id, meta)
        self._async_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            if plan is None:
                continue
            plan.block_ids = [list(ids) for ids in new.block_ids]
            if plan.saved_upto < 0:
                plan.saved_upto = new.num_computed_tokens // self.block_size
            self._plan_load(plan, new.req_id, meta)
            self._plan_saves(plan, new.req_id, new.num_computed_tokens + scheduled[new.req_id],
                             meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                plan.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                if not plan.block_ids:
                    plan.block_ids = [[] for _ in new_ids]
                for have, more in zip(plan.block_ids, new_ids):
                    have.extend(more)
            self._plan_load(plan, req_id, meta)
            self._plan_saves(plan, req_id, cached.num_computed_tokens[i] + scheduled[req_id],
                             meta)
        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        self._maybe_log("scheduler")
        return meta

    def _plan_load(self, plan: _Plan, req_id: str, meta: EmsConnectorMetadata) -> None:
        if not plan.load_planned:
            return
        plan.load_planned = False
        a, b = plan.local_blocks, plan.local_blocks + plan.load_blocks
        # A windowed group's blocks that are out of the window at the hit point are
        # vLLM's null block: their pages land there and are never read (vLLM reads
        # only the window), every other group gets every block.
        keys = self._hashes(plan, b)
        meta.loads.append(BlockTransfer(req_id, [ids[a:b] for ids in plan.block_ids],
                                        keys[a:], identities=plan.digests[a:len(keys)],
                                        is_async=self._hybrid))

    def _plan_saves(self, plan: _Plan, req_id: str, computed: int,
                    meta: EmsConnectorMetadata) -> None:
        if not self._can_save or not plan.block_ids:
            return
        n_prompt = len(plan.request.prompt_token_ids or ())
        done = min(computed, n_prompt) // self.block_size
        done = min(done, *(len(ids) for ids in plan.block_ids),
                   len(self._hashes(plan, done)))
        a = plan.saved_upto
        # Only blocks every group holds: a windowed group's block is null once out of
        # the window (a block computed in this step never is; one that is cannot be
        # saved whole, and neither can any block after it: keys are a prefix chain).
        for i in range(a, done):
            if any(ids[i] == NULL_BLOCK for ids in plan.block_ids):
                done = i
                break
        if done > a:
            if plan.write_out is None:
                plan.write_out = self._write_out(req_id, plan.request)
            meta.saves.append(BlockTransfer(req_id, [ids[a:done] for ids in plan.block_ids],
                                            self._hashes(plan, done)[a:],
                                            identities=plan.digests[a:done],
                                            event_hashes=self._event_hashes(plan, a, done),
                                            write_out=plan.write_out))
            plan.saved_upto = done
            plan.has_saves = True

    def _write_out(self, req_id: str, request: "Request") -> bool:
        """The request's ``kv_transfer_params["ems_write_out"]``, else the settings'; a
        bad value is logged once and the settings' kept (the request still runs)."""
        try:
            return request_write_out(request.kv_transfer_params, self.settings.write_out)
        except EmsException as exc:
            logger.warning("ems: request %s: %s; the saves keep write_out=%s", req_id, exc,
                           self.settings.write_out)
            return self.settings.write_out

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them again then (a
        load fails when the pool hung or lost them; the next request should hit). A
        failed asynchronous load (hybrid models) recomputes the whole request."""
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            plan = self._plans.get(req_id)
            if plan is not None:
                plan.saved_upto = -1
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for plan in self._plans.values():
            ids = plan.block_ids[0] if plan.block_ids else []
            for i, block in enumerate(ids[:plan.saved_upto]):
                if block in invalid:
                    plan.saved_upto = i
                    break

    @_timed  # hooks_s
    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, Optional[dict[str, Any]]]:
        self._lookups.pop(request.request_id, None)
        plan = self._plans.pop(request.request_id, None)
        # Saves were planned: the worker reports this request in finished_sending once
        # they are done, and only then may vLLM reuse its blocks (of every group).
        return bool(plan is not None and plan.has_saves), None

    # ------------------------------------------------------------ worker side
    @_timed  # hooks_s
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks are freed at once: its saves must be done first.
        for req_id in getattr(kv_connector_metadata, "preempted", ()):
            for fut in self._saves.get(req_id, ()):
                fut.result()

    @_timed  # hooks_s
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, EmsConnectorMetadata) or not meta.loads:
            return
        bs = self.block_size
        t0 = time.perf_counter()
        got = self._session.load([(t.hashes, chunk_descs(t.block_ids, bs))
                                  for t in meta.loads])
        loaded = failed = 0
        for i, t in enumerate(meta.loads):
            n = got[i]
            if self._ident is not None and n:
                # a 64-bit key of another prefix: its blocks are a miss from there on
                same = leading_identities(self._ident, t.block_ids[self._ident_group][:n],
                                          t.identities[:n], NULL_BLOCK)
                if same < n:
                    self._counters.add(key_collisions=1)
                    logger.warning("ems: block %d of request %s: a key collision (another "
                                   "prefix's block): recomputed", same, t.req_id)
                    n = same
            loaded += n
            missed = len(t.hashes) - n
            failed += missed
            if t.is_async:
                # vLLM counted every block of the hit: anything less recomputes the
                # request (never a partial restore)
                self._loaded.add(t.req_id)
                if missed:
                    self._load_failed.add(t.req_id)
            elif missed:
                self._load_errors.update(t.block_ids[0][n:])
        self._counters.add(tokens_loaded=loaded * bs, tokens_load_failed=failed * bs,
                           load_s=time.perf_counter() - t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer (one pool object per block)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save saves every layer of a block at once

    @_timed  # hooks_s
    def wait_for_save(self) -> None:
        """Submit the step's saves. With a windowed group (sliding window), wait until
        they are copied: vLLM frees a block once it leaves the window, at the next
        step's scheduling (with asynchronous scheduling, while this step still runs),
        and may hand it to another request, whose next step writes it; this step's
        end is the last moment its contents are sure to be the saved request's."""
        meta = self._connector_metadata
        if not isinstance(meta, EmsConnectorMetadata) or not meta.saves:
            return
        device = self._cuda_device
        bs = self.block_size
        submitted = []
        for t in meta.saves:
            futs = self._saves.setdefault(t.req_id, [])
            if self._skip_saves or self._disabled:
                continue
            if self._ident is not None:
                write_identities(self._ident, t.block_ids[self._ident_group], t.identities)
            # Where the forward's writes (and the identities') end on the engine's
            # stream: the save's copies wait for this event on their own stream, so
            # the engine never waits for a save (it synchronized its stream here).
            mark = None if device is None else cuda.engine_mark(cuda.torch_ops(), device)
            fut = self._session.save(t.hashes, chunk_descs(t.block_ids, bs),
                                     t.event_hashes or None, after=mark,
                                     write_out=t.write_out)
            if fut is None:
                self._counters.add(tokens_save_failed=len(t.hashes) * bs)
                continue
            start, n = time.perf_counter(), len(t.hashes)
            fut.add_done_callback(functools.partial(self._saved, start=start, n=n))
            futs.append(fut)
            submitted.append(fut)
        if self._windowed:
            for fut in submitted:
                fut.result()  # (bounded by save_timeout_ms)

    def _saved(self, fut: Future, start: float, n: int) -> None:
        ok = fut.result() if not fut.cancelled() else 0
        bs = self.block_size
        self._counters.add(tokens_saved=ok * bs, tokens_save_failed=(n - ok) * bs,
                           save_s=time.perf_counter() - start)

    @_timed  # hooks_s
    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        self._finishing.update(r for r in finished_req_ids if r in self._saves)
        done = {r for r in self._finishing if all(f.done() for f in self._saves[r])}
        for r in done:
            self._finishing.discard(r)
            del self._saves[r]
        loaded, self._loaded = self._loaded, set()
        self._maybe_log("worker")
        return (done or None), (loaded or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished`` plus the asynchronous loads that failed (vLLM recomputes
        those requests from their start)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._load_failed = self._load_failed, set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def flush(self) -> None:
        """Wait for every save submitted so far (each bounded by ``save_timeout_ms``)."""
        for futs in list(self._saves.values()):
            for fut in list(futs):
                fut.result()

    def shutdown(self) -> None:
        self.flush()
        self._maybe_log(self.role.name.lower(), force=True)
        self._session.close()

    # ------------------------------------------------------------ statistics
    def statistics(self) -> ConnectorStatistics:
        """This connector's cumulative counters (pool failures included)."""
        snap = self._counters.snapshot()
        return dataclasses.replace(snap, failures=self._session.failures)

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        data = self._counters.interval()
        return EmsConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None
                                 ) -> Optional[KVConnectorStats]:
        return EmsConnectorStats(data=dict(data or {}))

    def _maybe_log(self, role: str, force: bool = False) -> None:
        every = self.settings.log_interval_s
        now = time.monotonic()
        if not force and (every <= 0 or now - self._last_log < every):
            return
        self._last_log = now
        s = self.statistics()
        logger.info("ems: %s: %d lookups, tokens looked up %d / hit %d / loaded %d "
                    "(failed %d) / saved %d (failed %d), lookup %.3f s, load %.3f s, "
                    "save %.3f s, in hooks %.3f s, pool %s, %d failures", role, s.lookups,
                    s.tokens_looked_up, s.tokens_hit, s.tokens_loaded, s.tokens_load_failed,
                    s.tokens_saved, s.tokens_save_failed, s.lookup_s, s.load_s, s.save_s,
                    s.hooks_s,
                    self._session.state.value, s.failures)
