"""``EmsStorage``: the ems pool as the L3 storage of SGLang's hierarchical cache (HiCache).

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "ems",
        "module_path": "ems.integrations.sglang", "class_name": "EmsStorage",
        "interface_v1": 1}'

SGLang's factory builds ``EmsStorage(storage_config, kwargs)`` in every scheduler
process (one per TP/PP rank) and then calls ``register_mem_pool_host(host_pool)``. The
pool is found like every SDK client finds it (``EMS_POOL``, ``EMS_SOCKET_DIR``,
``EMS_ACCESS_ID``, ``EMS_ACCESS_KEY``); the extra config may also carry ``pool``,
``socket_dir``, ``access_id``, ``access_key``, ``timeout_ms`` (and the other
:class:`~ems.integrations.settings.StorageSettings`), which win. SGLang's own keys in
that mapping pass; any other key is refused, naming it.

Data path (``interface_v1``: SGLang calls ``batch_set_v1`` / ``batch_get_v1`` with
its host-pool indices): the host pool's ``get_page_buffer_meta(indices)`` gives the
address and size of each piece of each page (a page's K and V: per layer for
``layer_first``, one each for ``page_first`` / ``page_first_direct``, one for MLA);
those regions are handed to the SDK as ``KvBufferWrapper`` values of one V0 key per
page, so the pool copies straight between the host pool and its shared memory (no
copy of ours) and holds ONE object per page. Loads fill the same regions; a page
whose stored size differs is a miss.

Keys (:class:`~ems.integrations.hicache.PageKeys`): SGLang's page hash (a hex digest
chained over the prefix) plus the rank suffix SGLang requires of an L3, so that ranks
never share what they must not:
``<hash>[.<pool>]@<format>.tp<r>of<n>.pp<r>of<n>[.cp<r>of<n>][.dcp<r>of<n>]``,
``<format>`` a 12-hex digest of the model name and the host pool's page format (layout,
dtype, page size: layouts of the same size order a page's bytes differently). MLA KV
is the same on every TP rank: its keys carry no TP part and only the storage writer
(TP rank 0) saves; the others answer True without writing. Mamba state is TP-sharded
even in an MLA model. SGLang passes no per-request salt to L3: the tenant is fixed per
engine by its credentials.

Hybrid models (``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` with
``PoolTransfer``, where the installed SGLang defines them): every pool registered
through ``register_mem_host_pool_v2`` moves the same way under its own keys
(``<hash>.<pool>``); the hit is the minimum over pools (``all_pages``: every page of the
prefix; ``trailing_pages``: the last pages of it, as SWA and Mamba state hold).

Failures: every call returns within its deadline and never raises; a page that did
not move is ``False`` (never ``None``: SGLang's prefetch and backup threads die on
it and turn L3 off for the life of the process). The pool down at start does not
fail the constructor: the engine serves with misses and the pool session
(:mod:`ems.integrations.session`) picks the pool up when it answers, with one
warning per outage. A full pool refuses saves (``False``); loads still work.

OpenMP: the first time each SGLang thread (prefetch, prefetch I/O, backup) calls the
backend, it runs one small parallel torch op (:class:`~ems.integrations.openmp.
OpenMpJoin`; setting ``openmp_warmup``). That gives the thread an OpenMP team of its
own, as SGLang's ``file`` backend's torch ops give its prefetch thread, and puts a CPU
engine's process over GNU OpenMP's line (more managed threads than CPUs) where its
forward's barriers spin 100 iterations instead of 300,000 before they sleep. Without it
a hit through ems took 1.66 s against ``file``'s 0.75 s with one core kept busy; with
it 0.56 s (the module's docstring has the mechanism and the figures).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from ems.client.context_caching import ContextCaching
from ems.config import CcConfig, EmsConfig
from ems.futures import CcResult
from ems.integrations.counters import Counters
from ems.integrations.hicache import (
    FLAT_POOL,
    KV_POOL,
    EngineRank,
    HostPoolView,
    PageKeys,
    StorageStatistics,
)
from ems.integrations.openmp import OpenMpJoin
from ems.integrations.session import PoolSession
from ems.integrations.settings import StorageSettings
from ems.keys import KvBufferWrapper

try:  # the hybrid-pool API: its own module in newer SGLang, hicache_storage before
    from sglang.srt.mem_cache.pool_transfer import (
        PoolHitPolicy,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError:
    try:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[no-redef,unused-ignore]
            PoolHitPolicy,
            PoolTransfer,
            PoolTransferResult,
        )
    except ImportError:
        PoolHitPolicy = PoolTransfer = PoolTransferResult = None  # type: ignore[misc,assignment,unused-ignore]

try:  # what SGLang's metrics collector takes from get_stats()
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError:
    try:
        from sglang.srt.metrics.collector import StorageMetrics  # type: ignore[no-redef,unused-ignore]
    except ImportError:
        StorageMetrics = None  # type: ignore[misc,assignment,unused-ignore]

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

__all__ = ["EmsStorage"]

logger = logging.getLogger(__name__)

_HYBRID_MISSING = ("this SGLang has no hybrid-pool storage API (PoolTransfer in "
                   "sglang.srt.mem_cache.pool_transfer or hicache_storage)")


if StorageMetrics is not None:
    @dataclasses.dataclass
    class EmsStorageMetrics(StorageMetrics):  # type: ignore[misc,valid-type,unused-ignore]
        """SGLang's per-interval ``StorageMetrics`` (pages and GB/s per batch, which it
        turns into histograms) plus this backend's totals."""

        totals: StorageStatistics = dataclasses.field(default_factory=StorageStatistics)


# ---------------------------------------------------------------- the backend
class EmsStorage(HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: Optional[dict[str, Any]] = None) -> None:
        self.settings = StorageSettings.from_sources(storage_config.extra_config or {})
        self.rank = EngineRank.of(storage_config)
        model = self.settings.model_id or self.rank.model_name or "sglang"
        self.keys = PageKeys.of(self.rank, model)
        self._pools: dict[str, HostPoolView] = {}
        self._counters = Counters(StorageStatistics)
        self._openmp = OpenMpJoin(self.settings.openmp_warmup)
        rank_id = self.rank.pp_rank * self.rank.tp_size + self.rank.tp_rank
        config = EmsConfig(access_id=self.settings.access_id,
                           access_key=self.settings.access_key,
                           cc_config=CcConfig(rank_id=rank_id, device_id=self.rank.tp_rank,
                                              model_id="sglang",
                                              tp_world_size=self.rank.tp_size,
                                              pp_world_size=self.rank.pp_size))
        # never raises because the pool is down: the session goes DOWN and probes
        self._session = PoolSession.get(self.settings, config)
        logger.info("ems: EmsStorage for %s (tp %d/%d, pp %d/%d%s), pool %s", model,
                    self.rank.tp_rank, self.rank.tp_size, self.rank.pp_rank,
                    self.rank.pp_size, ", MLA" if self.rank.is_mla_model else "",
                    self._session.state.value)

    # ------------------------------------------------------------ host pools
    def register_mem_pool_host(self, mem_pool_host: "HostKVCache") -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._pools[KV_POOL] = HostPoolView.of(KV_POOL, mem_pool_host)
        logger.info("ems: host pool %s, page %d tokens", self._pools[KV_POOL].layout,
                    self._pools[KV_POOL].page_size)

    def register_mem_host_pool_v2(self, host_pool: "HostKVCache", host_pool_name: Any
                                  ) -> None:
        if PoolTransfer is None:
            raise NotImplementedError(_HYBRID_MISSING)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools[str(host_pool_name)] = HostPoolView.of(str(host_pool_name), host_pool)

    # ------------------------------------------------------------ the v1 path
    def batch_exists(self, keys: list[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading pages of ``keys`` in the pool, within ``lookup_timeout_ms``."""
        return self._lookup(self._storage_keys(keys, KV_POOL))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        return self._move("load", KV_POOL, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        return self._move("save", KV_POOL, keys, host_indices)

    def _storage_keys(self, keys: Sequence[str], pool: str) -> list[str]:
        """The pool's keys of these pages of ``pool`` (the flat forms' keys follow the
        KV pool's format); none before the pool is registered."""
        view = self._pools.get(KV_POOL if pool == FLAT_POOL else pool)
        if view is None:
            return []
        return [self.keys.key(k, pool, view.page_format) for k in keys]

    def _lookup(self, storage_keys: Sequence[str]) -> int:
        self._openmp.join()
        if not storage_keys:
            return 0
        t0 = time.perf_counter()
        hits = self._session.lookup(list(storage_keys))
        self._counters.add(lookups=1, pages_looked_up=len(storage_keys), pages_hit=hits,
                           lookup_s=time.perf_counter() - t0)
        return hits

    def _move(self, op: str, pool: str, keys: Sequence[str],
              host_indices: Optional[torch.Tensor]) -> list[bool]:
        """Load or save the pages ``keys`` of ``pool`` at ``host_indices``: per page
        whether it moved (a prefix of True, then False)."""
        self._openmp.join()
        n = len(keys)
        if n == 0:
            return []
        if op == "save" and not self.keys.tp_sharded(pool) and not self.rank.is_writer:
            return [True] * n  # TP rank 0 writes the MLA pages every rank holds
        view = self._pools.get(pool)
        if view is None or host_indices is None:
            logger.error("ems: %s of %d pages of pool %r, which is not registered", op, n,
                         pool)
            return [False] * n
        try:
            values = view.page_values(host_indices, n)
        except (ValueError, NotImplementedError, AssertionError) as exc:
            logger.error("ems: %s: %s", op, exc)
            return [False] * n
        storage_keys = self._storage_keys(keys, pool)
        ok = self._request(op, storage_keys, values)
        page_bytes = sum(v.length for v in values[0])
        if op == "load":
            self._counters.add(pages_loaded=ok, pages_load_failed=n - ok,
                               bytes_loaded=ok * page_bytes)
        else:
            self._counters.add(pages_saved=ok, pages_save_failed=n - ok,
                               bytes_saved=ok * page_bytes)
        return [i < ok for i in range(n)]

    def _request(self, op: str, storage_keys: list[str],
                 values: list[list[KvBufferWrapper]]) -> int:
        """One SDK load or save of these keys within its deadline: the leading count."""
        self._openmp.join()
        if not storage_keys:
            return 0
        option = self.settings.option(op)  # (a save's write_out: the extra config's)

        def call(cc: ContextCaching) -> CcResult:
            if op == "load":
                return cc.load(option, storage_keys, values)
            return cc.save(option, storage_keys, values)

        t0 = time.perf_counter()
        ok = self._session.request(op, call)
        self._counters.add(**{f"{op}_s": time.perf_counter() - t0})
        return ok

    # ------------------------------------------------------------ hybrid pools (v2)
    def batch_exists_v2(self, keys: list[str],
                        pool_transfers: Optional[list["PoolTransfer"]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None
                        ) -> "PoolTransferResult":
        """Leading pages usable in every pool: the KV prefix, cut where a sidecar pool
        cannot restore it (``all_pages``: a page of the pool is missing;
        ``trailing_pages``: the pool's last pages before that length are)."""
        if PoolTransfer is None:
            raise NotImplementedError(_HYBRID_MISSING)
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            policy = transfer.hit_policy
            pool_keys = self._storage_keys(keys[:kv_pages], name)
            if len(pool_keys) < kv_pages:  # a pool SGLang never registered: no hit
                ok, boundary = set(), 0
            elif policy == PoolHitPolicy.ALL_PAGES:
                boundary = self._lookup(pool_keys)
                ok = set(range(1, boundary + 1))
            elif policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                present = self._presence(pool_keys)
                ok = {p for p in range(1, kv_pages + 1)
                      if all(present[max(0, p - window):p])}
                boundary = max(ok, default=0)
            else:
                logger.warning("ems: pool %s: hit policy %s is not supported; its pages "
                               "are not looked up", name, policy)
                continue
            if boundary:
                hit_count[transfer.name] = boundary
            restorable &= ok
        final = max(restorable, default=0)
        fields = {f.name for f in dataclasses.fields(PoolTransferResult)}
        extra = ({"restorable_prefix_pages": sorted(restorable)}
                 if "restorable_prefix_pages" in fields else {})
        return PoolTransferResult(kv_hit_pages=final, extra_pool_hit_pages=hit_count,
                                  **extra)

    def _presence(self, storage_keys: list[str]) -> list[bool]:
        """Per key, whether it is stored: one leading-count lookup per gap."""
        out: list[bool] = []
        while len(out) < len(storage_keys):
            hits = self._lookup(storage_keys[len(out):])
            out.extend([True] * hits)
            if len(out) < len(storage_keys):
                out.append(False)
        return out

    def batch_get_v2(self, transfers: list["PoolTransfer"],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, list[bool]]:
        if PoolTransfer is None:
            raise NotImplementedError(_HYBRID_MISSING)
        return {t.name: self._move("load", str(t.name), t.keys or [], t.host_indices)
                for t in transfers}

    def batch_set_v2(self, transfers: list["PoolTransfer"],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, list[bool]]:
        if PoolTransfer is None:
            raise NotImplementedError(_HYBRID_MISSING)
        return {t.name: self._move("save", str(t.name), t.keys or [], t.host_indices)
                for t in transfers}

    # ------------------------------------------------------------ the older forms
    # SGLang without ``interface_v1`` passes flat page tensors: one region each.
    def batch_get(self, keys: list[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> list[Optional[torch.Tensor]]:
        if not keys or target_locations is None:
            return [None] * len(keys)
        ok = self._request("load", self._storage_keys(keys, FLAT_POOL),
                           [[_region(t)] for t in target_locations])
        return [t if i < ok else None for i, t in enumerate(target_locations)]

    def batch_set(self, keys: list[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if not keys or values is None:
            return False
        if not self.rank.is_writer:
            return True
        pages = [v.contiguous() for v in values]  # kept alive across the save
        ok = self._request("save", self._storage_keys(keys, FLAT_POOL),
                           [[_region(t)] for t in pages])
        return ok == len(keys)

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(self, key: str, value: Optional[Any] = None,
            target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
            ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------ lifecycle, metrics
    def statistics(self) -> StorageStatistics:
        return dataclasses.replace(self._counters.snapshot(),
                                   failures=self._session.failures,
                                   openmp_threads_joined=self._openmp.threads_joined)

    def get_stats(self) -> Optional["StorageMetrics"]:
        """SGLang's ``StorageMetrics`` of the interval since the last call (pages per
        load/save call and their GB/s, approximated by the interval's averages) with
        this backend's totals attached (``.totals``); None on an SGLang without it."""
        d = self._counters.interval()
        if StorageMetrics is None:
            return None
        m = EmsStorageMetrics(totals=self.statistics())
        if d.get("pages_loaded"):
            m.prefetch_pgs.append(int(d["pages_loaded"]))
            if d.get("load_s"):
                m.prefetch_bandwidth.append(d.get("bytes_loaded", 0) / d["load_s"] / 1e9)
        if d.get("pages_saved"):
            m.backup_pgs.append(int(d["pages_saved"]))
            if d.get("save_s"):
                m.backup_bandwidth.append(d.get("bytes_saved", 0) / d["save_s"] / 1e9)
        return m

    def clear(self) -> None:
        logger.warning("ems: clear() is not supported: the pool's pages are shared by "
                       "every engine of the tenant; they age out by eviction")

    def close(self) -> None:
        s = self.statistics()
        logger.info("ems: EmsStorage closing: %d lookups, pages looked up %d / hit %d / "
                    "loaded %d (failed %d) / saved %d (failed %d), %d failures",
                    s.lookups, s.pages_looked_up, s.pages_hit, s.pages_loaded,
                    s.pages_load_failed, s.pages_saved, s.pages_save_failed, s.failures)
        self._session.close()


def _region(t: torch.Tensor) -> KvBufferWrapper:
    return KvBufferWrapper(int(t.data_ptr()), int(t.numel() * t.element_size()))
