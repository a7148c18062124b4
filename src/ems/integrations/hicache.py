"""SGLang's HiCache objects as ``EmsStorage`` uses them, and the keys of its pages (no
SGLang import, so they are unit-tested in the project's own environment).

* :class:`HostPoolView` -- a host pool's page size and ``get_page_buffer_meta``: the
  regions (address, bytes) of each page, handed to the SDK as one V0 value per page.
* :class:`EngineRank` -- this scheduler's place in the engine (TP, PP, attention CP,
  DCP ranks; MLA), read from SGLang's ``HiCacheStorageConfig``.
* :class:`PageKeys` -- a page's key in the pool: SGLang's page hash with the rank
  suffix SGLang requires of an L3.
* :class:`StorageStatistics` -- the backend's cumulative counters.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import TYPE_CHECKING, Any, Callable

from ems.keys import MAX_KEY_LEN, KvBufferWrapper

if TYPE_CHECKING:
    import torch

__all__ = ["FLAT_POOL", "KV_POOL", "EngineRank", "HostPoolView", "PageKeys",
           "StorageStatistics"]

#: the pool name of SGLang's KV pages (``PoolName.KV``)
KV_POOL = "kv"
#: keys of the single-key and list forms (``get``/``set``/``batch_get``/``batch_set``):
#: their values are SGLang's flat pages, whose byte order differs from the v1 regions'
#: for ``layer_first``, so they live under their own keys
FLAT_POOL = "flat"


@dataclasses.dataclass(frozen=True)
class StorageStatistics:
    """Cumulative counters of one ``EmsStorage`` (``statistics()``; ``get_stats()``
    hands SGLang its per-interval metrics with these totals attached)."""

    lookups: int = 0
    pages_looked_up: int = 0
    pages_hit: int = 0
    pages_loaded: int = 0
    pages_load_failed: int = 0
    pages_saved: int = 0
    pages_save_failed: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    lookup_s: float = 0.0
    load_s: float = 0.0
    save_s: float = 0.0
    failures: int = 0  # pool failures (a call that got no cache)
    openmp_threads_joined: int = 0  # SGLang threads that ran the OpenMP warm-up op


@dataclasses.dataclass(frozen=True)
class HostPoolView:
    """What this backend uses of an SGLang host pool (``HostKVCache``): its page size
    and ``get_page_buffer_meta``. SGLang's pools are untyped foreign objects whose
    attributes differ by kind (MHA, MLA, Mamba ...); this view reads them once, at
    registration, so the rest of the module works on typed values."""

    name: str
    page_size: int
    layout: str
    dtype: str
    buffer_meta: Callable[[torch.Tensor], Any]

    @classmethod
    def of(cls, name: str, pool: Any) -> "HostPoolView":
        return cls(name=name, page_size=int(pool.page_size), layout=str(pool.layout),
                   dtype=str(pool.dtype), buffer_meta=pool.get_page_buffer_meta)

    @property
    def page_format(self) -> str:
        """What the bytes of a stored page mean: the layout orders them (``layer_first``
        K0 V0 K1 V1 ..., ``page_first`` token-major, ``page_first_direct`` layer-major:
        the same size each), the dtype reads them."""
        return f"{self.layout}/{self.dtype}/{self.page_size}"

    def page_values(self, host_indices: torch.Tensor, n_pages: int
                    ) -> list[list[KvBufferWrapper]]:
        """Per page, its regions (address, bytes) in the host pool, in SGLang's order.
        ``host_indices``: ``n_pages * page_size`` slots, page-aligned."""
        if host_indices.numel() != n_pages * self.page_size:
            raise ValueError(f"pool {self.name!r}: {host_indices.numel()} host slots for "
                             f"{n_pages} pages of {self.page_size}")
        meta = self.buffer_meta(host_indices)
        ptrs, sizes = list(meta[0]), list(meta[1])
        per = len(ptrs) // n_pages if n_pages else 0
        if per == 0 or per * n_pages != len(ptrs) or len(sizes) != len(ptrs):
            raise ValueError(f"pool {self.name!r}: get_page_buffer_meta gave {len(ptrs)} "
                             f"regions for {n_pages} pages")
        return [[KvBufferWrapper(int(p), int(s))
                 for p, s in zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])]
                for i in range(n_pages)]


@dataclasses.dataclass(frozen=True)
class EngineRank:
    """This scheduler's place in the engine, from SGLang's ``HiCacheStorageConfig``
    (a dataclass whose fields grow with SGLang's versions: read by name, with the
    defaults of the versions that lack them)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    is_mla_model: bool = False
    model_name: str = ""

    @classmethod
    def of(cls, config: Any) -> "EngineRank":
        given = dataclasses.asdict(config)
        mine = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in given.items() if k in mine and v is not None}
        return cls(**values)

    @property
    def is_writer(self) -> bool:
        """MLA KV is the same on every TP rank: one writer per DCP shard (TP rank ==
        DCP rank; rank 0 without DCP); every rank writes its own MHA shard."""
        return not self.is_mla_model or self.tp_rank == self.dcp_rank


@dataclasses.dataclass(frozen=True)
class PageKeys:
    """The pool's V0 key of a page of a pool: ``<hash>[.<pool>]@<format>.tp<r>of<n>
    .pp<r>of<n>[.cp<r>of<n>][.dcp<r>of<n>]``, ``<format>`` a 12-hex digest of the model
    and the pool's page format (:attr:`HostPoolView.page_format`), so that a page stored
    by another model, layout or dtype is never read as this one's."""

    model: str
    suffix: str  # for data that is the same on every TP rank of an MLA model
    tp_suffix: str  # for TP-sharded data

    @classmethod
    def of(cls, rank: EngineRank, model: str) -> "PageKeys":
        shard = f".pp{rank.pp_rank}of{rank.pp_size}"
        if rank.attn_cp_size > 1:  # each CP rank holds a disjoint slice of every page
            shard += f".cp{rank.attn_cp_rank}of{rank.attn_cp_size}"
        if rank.dcp_size > 1:
            shard += f".dcp{rank.dcp_rank}of{rank.dcp_size}"
        tp_suffix = f".tp{rank.tp_rank}of{rank.tp_size}{shard}"
        return cls(model=model, suffix=shard if rank.is_mla_model else tp_suffix,
                   tp_suffix=tp_suffix)

    def tp_sharded(self, pool: str) -> bool:
        return self.suffix == self.tp_suffix or pool == "mamba"

    def key(self, page_hash: str, pool: str, page_format: str) -> str:
        base = page_hash if pool == KV_POOL else f"{page_hash}.{pool}"
        key = (f"{base}@{_digest(self.model, page_format)}"
               + (self.tp_suffix if self.tp_sharded(pool) else self.suffix))
        if len(key) >= MAX_KEY_LEN:  # a hash longer than SGLang's 64 hex digits
            key = hashlib.blake2b(key.encode(), digest_size=32).hexdigest()
        return key


@functools.lru_cache(maxsize=64)
def _digest(model: str, page_format: str) -> str:
    return hashlib.blake2b(f"{model}|{page_format}".encode(), digest_size=6).hexdigest()
