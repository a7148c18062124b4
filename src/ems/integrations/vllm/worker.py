"""The worker's half of ``EmsConnector`` (one per rank): it registers the KV cache
tensors and moves the blocks the scheduler's metadata names. Per step::

    handle_preemptions  -- wait for the saves of preempted requests
    start_load_kv       -- load, wait (SDK deadline); a miss or a failure ->
                           get_block_ids_with_load_errors -> vLLM recomputes
    (forward)
    wait_for_save       -- submit the step's saves, return at once
    get_finished        -- finished_sending: a request once every save of it is done

It never imports the scheduler's half: the two meet in
:mod:`ems.integrations.vllm.metadata`.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future
from typing import Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ems.client import cuda
from ems.integrations.kv_layout import (
    NULL_BLOCK,
    canonical_layer,
    chunk_descs,
    identity_shape,
    leading_identities,
    mirror_shapes,
    write_identities,
)
from ems.integrations.session import PoolSession
from ems.integrations.settings import ConnectorSettings
from ems.integrations.vllm.compat import transfer_results
from ems.integrations.vllm.half import CacheGroups, ConnectorHalf, _timed
from ems.integrations.vllm.metadata import EmsConnectorMetadata

__all__ = ["WorkerHalf"]

logger = logging.getLogger(__name__)


class WorkerHalf(ConnectorHalf):
    """See the module docstring."""

    role_name = "worker"

    def __init__(self, settings: ConnectorSettings, groups: CacheGroups,
                 session: PoolSession, can_load: bool, can_save: bool,
                 skip_saves: bool) -> None:
        super().__init__(settings, groups, session, can_load, can_save)
        # MLA: every TP rank has the same KV, and only TP rank 0 saves it
        self._skip_saves = skip_saves
        self._ident: Optional[torch.Tensor] = None  # the identity pages
        # the engine's CUDA device (set by register_kv_caches; None: CPU)
        self._cuda_device: Optional[torch.device] = None
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()  # asynchronous loads done (finished_recving)
        self._load_failed: set[str] = set()  # ... that failed (failed_recving)
        self._saves: dict[str, list[Future]] = {}
        self._finishing: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._disabled:
            return
        groups, bs = self.groups, self.block_size
        layers: list[list[torch.Tensor]] = []
        page = None
        for g, (spec, names) in enumerate(zip(groups.specs, groups.layers)):
            want, want_page, _ = mirror_shapes(spec, bs, groups.on_cpu)
            for name in names:
                kv = kv_caches.get(name)
                if kv is None:
                    self._disable(f"vLLM registered no KV cache for layer {name!r} "
                                  f"(group {g})")
                    return
                try:
                    tensors, page = canonical_layer(kv, bs, spec, groups.on_cpu)
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
            if g == groups.ident_group:
                num_blocks = layers[-1][0].shape[0]
                self._ident = torch.zeros((num_blocks, *identity_shape(bs)),
                                          dtype=torch.uint8, device=layers[-1][0].device)
                layers.append([self._ident])
        first = layers[0][0]
        self._cuda_device = first.device if first.device.type == "cuda" else None
        self._session.register(layers, page, real=True, groups=groups.layer_groups())
        logger.info("ems: registered %d layers in %d KV cache group(s) (%s) of %s pages",
                    len(layers), len(groups.specs), ", ".join(map(str, groups.kinds)),
                    "opaque" if page else "paged")

    def _disable(self, why: str) -> None:
        self._disabled = why
        logger.warning("ems: EmsConnector disabled: %s", why)

    # ------------------------------------------------------------ loads
    @_timed
    def handle_preemptions(self, meta: KVConnectorMetadata) -> None:
        # A preempted request's blocks are freed at once: its saves must be done first.
        if not isinstance(meta, EmsConnectorMetadata):
            return
        for req_id in meta.preempted:
            for fut in self._saves.get(req_id, ()):
                fut.result()

    @_timed
    def start_load_kv(self, meta: Optional[KVConnectorMetadata]) -> None:
        if not isinstance(meta, EmsConnectorMetadata) or not meta.loads:
            return
        bs, ident_group = self.block_size, self.groups.ident_group
        t0 = time.perf_counter()
        got = self._session.load([(t.hashes, chunk_descs(t.block_ids, bs))
                                  for t in meta.loads])
        loaded = failed = 0
        for i, t in enumerate(meta.loads):
            n = got[i]
            if self._ident is not None and n:
                # a 64-bit key of another prefix: its blocks are a miss from there on
                same = leading_identities(self._ident, t.block_ids[ident_group][:n],
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # ------------------------------------------------------------ saves
    @_timed
    def wait_for_save(self, meta: Optional[KVConnectorMetadata]) -> None:
        """Submit the step's saves. With a windowed group (sliding window), wait until
        they are copied: vLLM frees a block once it leaves the window, at the next
        step's scheduling (with asynchronous scheduling, while this step still runs),
        and may hand it to another request, whose next step writes it; this step's
        end is the last moment its contents are sure to be the saved request's."""
        if not isinstance(meta, EmsConnectorMetadata) or not meta.saves:
            return
        device = self._cuda_device
        bs, ident_group = self.block_size, self.groups.ident_group
        submitted = []
        for t in meta.saves:
            futs = self._saves.setdefault(t.req_id, [])
            if self._skip_saves or self._disabled:
                continue
            if self._ident is not None:
                write_identities(self._ident, t.block_ids[ident_group], t.identities)
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
        if self.groups.windowed:
            for fut in submitted:
                fut.result()  # (bounded by save_timeout_ms)

    def _saved(self, fut: Future, start: float, n: int) -> None:
        ok = fut.result() if not fut.cancelled() else 0
        bs = self.block_size
        self._counters.add(tokens_saved=ok * bs, tokens_save_failed=(n - ok) * bs,
                           save_s=time.perf_counter() - start)

    @_timed
    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        self._finishing.update(r for r in finished_req_ids if r in self._saves)
        done = {r for r in self._finishing if all(f.done() for f in self._saves[r])}
        for r in done:
            self._finishing.discard(r)
            del self._saves[r]
        loaded, self._loaded = self._loaded, set()
        self._maybe_log()
        return (done or None), (loaded or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished`` plus the asynchronous loads that failed (vLLM recomputes
        those requests from their start)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._load_failed = self._load_failed, set()
        return transfer_results(set(sending or ()), set(recving or ()), failed)

    def flush(self) -> None:
        """Wait for every save submitted so far (each bounded by ``save_timeout_ms``)."""
        for futs in list(self._saves.values()):
            for fut in list(futs):
                fut.result()
