"""vLLM's KV cache as ems registers it, and the keys of its blocks (no vLLM import).

* :func:`canonical_layer` -- one layer's cache tensor as the tensors ems registers:

  ======================================================  ==========================
  vLLM's tensor (one layer)                               registered as
  ======================================================  ==========================
  CPU ``[blocks, kv_heads, block_size, 2*head]`` (0.32)   one opaque page per block,
  or the same storage ``[blocks, kv_heads, 2*bs, head]``  viewed ``[blocks, kv_heads,
                                                          2*block_size, head]``
  ``[2, blocks, block_size, heads, head]`` (K/V split)    K and V, paged
  ``[blocks, 2, block_size, heads, head]``                K and V, paged
  MLA ``[blocks, block_size, dim]``                       one tensor, paged
  ======================================================  ==========================

* :func:`mirror_shapes` -- the same per-block shapes from vLLM's KV cache spec alone,
  for the scheduler process, which has no tensors (it registers them on ``meta``).
  The worker checks that its real tensors give these very shapes.
* :func:`key64` -- an engine block hash (bytes) as the SDK's signed 64-bit int.
* :func:`block_slots` -- the slot_mapping of whole blocks.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

__all__ = ["block_slots", "canonical_layer", "key64", "mirror_shapes"]


def key64(block_hash: Any) -> int:
    """The engine's block hash (bytes, or an int) as a signed 64-bit int."""
    if isinstance(block_hash, int):
        h = block_hash & ((1 << 64) - 1)
        return h - (1 << 64) if h >= 1 << 63 else h
    digest = hashlib.blake2b(bytes(block_hash), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def mirror_shapes(spec: Any, block_size: int, on_cpu: bool
                  ) -> tuple[list[tuple[int, ...]], Optional[int], bool]:
    """Per-layer per-block tensor shapes the worker registers (without dim 0), the
    opaque page size (or None for paged tensors), and whether it is MLA."""
    is_mla = type(spec).__name__.startswith("MLA")
    if is_mla:
        return [(block_size, spec.head_size)], None, True
    if on_cpu:
        return [(spec.num_kv_heads, 2 * block_size, spec.head_size)], block_size, False
    return [(block_size, spec.num_kv_heads, spec.head_size)] * 2, None, False


def canonical_layer(kv: torch.Tensor, block_size: int, spec: Any, on_cpu: bool
                    ) -> tuple[list[torch.Tensor], Optional[int]]:
    """vLLM's cache tensor of one layer as the tensors ems registers (see module doc)."""
    shape = tuple(kv.shape)
    heads, head = getattr(spec, "num_kv_heads", 0), getattr(spec, "head_size", 0)
    if (on_cpu and kv.dim() == 4 and shape[1] == heads and kv[0].is_contiguous()
            and kv[0].numel() == heads * 2 * block_size * head):
        # CPU: [num_blocks, kv_heads, block_size, 2*head] (0.32) or the same storage as
        # [num_blocks, kv_heads, 2*block_size, head]: always registered as the latter.
        return [kv.view(shape[0], heads, 2 * block_size, head)], block_size
    if kv.dim() == 5 and shape[0] == 2 and shape[2] == block_size:
        return [kv[0], kv[1]], None  # [2, num_blocks, block_size, heads, head]
    if kv.dim() == 5 and shape[1] == 2 and shape[2] == block_size:
        return [kv[:, 0], kv[:, 1]], None  # [num_blocks, 2, block_size, heads, head]
    if kv.dim() == 3 and shape[1] == block_size:
        return [kv], None  # MLA: [num_blocks, block_size, dim]
    raise ValueError(f"unsupported KV cache layout {shape} (block_size {block_size})")


def block_slots(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Every slot of ``block_ids`` in order (``block * block_size + position``)."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1)
