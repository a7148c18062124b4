"""The scheduler's half of ``EmsConnector`` (the engine-core process, no KV tensors):
it looks blocks up in the pool, plans each step's loads and saves into the metadata
(:mod:`ems.integrations.vllm.metadata`) and keeps a request's blocks until its saves
are done. Per request::

    get_num_new_matched_tokens  -- exists(leading full prompt blocks) within
        |                          lookup_timeout_ms; never the last prompt token
    update_state_after_alloc    -- remember the hit (local blocks + pool blocks)
    build_connector_meta        -- loads: pool blocks -> their allocated block ids
        |                          saves: full prompt blocks computed by this step
        |                          (every chunk of a chunked prefill)
    update_connector_output     -- blocks that failed to load are saved again
    request_finished            -- True when saves were planned: vLLM keeps the blocks
                                   until the worker reports the request in
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ems.errors import EmsException
from ems.integrations.block_keys import ROOT, block_digest, event_hash, key_of
from ems.integrations.kv_layout import NULL_BLOCK, identity_shape, mirror_shapes
from ems.integrations.session import PoolSession, request_write_out
from ems.integrations.settings import ConnectorSettings
from ems.integrations.vllm.compat import load_failures, skips_prefix_cache
from ems.integrations.vllm.half import CacheGroups, ConnectorHalf, _timed
from ems.integrations.vllm.metadata import BlockTransfer, EmsConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["Lookup", "SchedulerHalf"]

logger = logging.getLogger(__name__)


class Lookup(NamedTuple):
    """A request's last lookup, from ``get_num_new_matched_tokens`` to
    ``update_state_after_alloc`` (and to a repeated question within
    ``lookup_reuse_ms``)."""

    local_blocks: int  # leading blocks vLLM had (its prefix cache)
    hits: int  # blocks after those that the pool holds
    asked_at: float  # time.monotonic() of the lookup


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


class SchedulerHalf(ConnectorHalf):
    """See the module docstring."""

    role_name = "scheduler"

    def __init__(self, settings: ConnectorSettings, groups: CacheGroups,
                 session: PoolSession, can_load: bool, can_save: bool,
                 hash_block_size: int) -> None:
        super().__init__(settings, groups, session, can_load, can_save)
        self._hash_stride = self.block_size // hash_block_size
        self._plans: dict[str, _Plan] = {}
        self._lookups: dict[str, Lookup] = {}
        self._async_loads: list[str] = []  # allocated, to load in the next step
        if not self._disabled:
            self._register_mirror()

    def _register_mirror(self) -> None:
        """Register the worker's layout on ``meta`` tensors: the SDK's keys carry the
        cache layout, so the scheduler's lookups find the worker's saves."""
        groups = self.groups
        layers: list[list[torch.Tensor]] = []
        page = None
        for g, (spec, names) in enumerate(zip(groups.specs, groups.layers)):
            shapes, page, _ = mirror_shapes(spec, self.block_size, groups.on_cpu)
            for _ in names:
                layers.append([torch.empty((1, *s), dtype=spec.dtype, device="meta")
                               for s in shapes])
            if g == groups.ident_group:
                layers.append([torch.empty((1, *identity_shape(self.block_size)),
                                           dtype=torch.uint8, device="meta")])
        self._session.register(layers, page, real=False, groups=groups.layer_groups())

    # ------------------------------------------------------------ keys
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

    # ------------------------------------------------------------ hooks
    @_timed
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[Optional[int], bool]:
        """Leading whole blocks after vLLM's own hit that the pool holds. A pool object
        holds every KV cache group's pages of its block, so a hit has every group
        (the minimum over groups is the object count); a hybrid model loads them
        asynchronously (see :class:`~ems.integrations.vllm.half.CacheGroups`)."""
        prompt = request.prompt_token_ids
        if self._disabled or not prompt:
            return 0, False
        bs, hybrid = self.block_size, self.groups.hybrid
        last = (len(prompt) - 1) // bs  # full blocks before the last prompt token
        first = num_computed_tokens // bs
        plan = self._plans.setdefault(request.request_id, _Plan(request))
        now = time.monotonic()
        prev = self._lookups.get(request.request_id)
        if prev is not None and prev.local_blocks == first and \
                now - prev.asked_at < self.settings.lookup_reuse_ms / 1000.0:
            # asked again while waiting for blocks
            return prev.hits * bs, hybrid and prev.hits > 0
        hits = 0
        if self._can_load and last > first and not skips_prefix_cache(request):
            t0 = time.perf_counter()
            hashes = self._hashes(plan, last)[first:]
            hits = self._session.lookup(hashes, [bs] * len(hashes)) if hashes else 0
            if hits * bs < max(self.settings.min_load_tokens, 1):
                hits = 0
            self._counters.add(lookups=1, tokens_looked_up=len(hashes) * bs,
                               tokens_hit=hits * bs, lookup_s=time.perf_counter() - t0)
        # vLLM's own cache had ``first`` blocks: they need no save either
        self._lookups[request.request_id] = Lookup(first, hits, now)
        return hits * bs, hybrid and hits > 0

    @_timed
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        plan = self._plans.setdefault(request.request_id, _Plan(request))
        first, hits, _ = self._lookups.pop(
            request.request_id,
            Lookup(request.num_computed_tokens // self.block_size, 0, 0.0))
        n_load = num_external_tokens // self.block_size
        plan.local_blocks = first
        plan.load_blocks = min(n_load, hits) if num_external_tokens else 0
        plan.load_planned = plan.load_blocks > 0
        plan.saved_upto = max(plan.saved_upto, first + plan.load_blocks)
        if plan.load_planned and self.groups.hybrid:
            # An asynchronous load: the request waits (not scheduled) until the
            # worker reports it; its blocks are these, in every group.
            plan.block_ids = [list(ids) for ids in blocks.get_block_ids()]
            self._async_loads.append(request.request_id)

    @_timed
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
        self._maybe_log()
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
                                        is_async=self.groups.hybrid))

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
        failed = load_failures(connector_output)
        for req_id in failed.failed_recving:
            plan = self._plans.get(req_id)
            if plan is not None:
                plan.saved_upto = -1
        if not failed.invalid_block_ids:
            return
        for plan in self._plans.values():
            ids = plan.block_ids[0] if plan.block_ids else []
            for i, block in enumerate(ids[:plan.saved_upto]):
                if block in failed.invalid_block_ids:
                    plan.saved_upto = i
                    break

    @_timed
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
