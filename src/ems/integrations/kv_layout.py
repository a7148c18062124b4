"""vLLM's KV cache as ems registers it (no vLLM import).

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
* :func:`group_kind` -- what ems does with a KV cache group of a kind (below);
  :func:`is_mla` -- whether its layout is MLA's (one latent tensor per layer).
* :func:`chunk_descs` -- the SDK's chunk_descs of whole blocks, per KV cache group.
* :func:`identity_shape`, :func:`write_identities`, :func:`leading_identities` -- the
  identity pages: each block's 32-byte digest (``block_keys``) in a small tensor the
  connector registers as one more layer, so it travels in the block's pool object and
  a load can tell a key collision from its own block.

KV cache groups (hybrid models, vLLM's hybrid KV cache manager): each group has its
own block ids, and the pool object of a block holds, group by group, every layer's
page of that block (the SDK's layer groups), so a block is in the pool with every
group or not at all: a hit is the minimum over groups by construction. Per kind:

=====================  =======================  ======================================
group kind             saved                    loaded at a hit of ``h`` blocks
=====================  =======================  ======================================
full attention, MLA    every full prompt block  every block
sliding window,        every full prompt block  the blocks vLLM gives ids to (the
chunked local attn     (copied before the step  window before ``h``); its null block
                       ends: vLLM reuses a      gets the others' pages, and vLLM never
                       block once out of the    reads it
                       window)
Mamba / linear attn,   -- (the connector turns itself off: its state is per request,
anything else          not per block of tokens)
=====================  =======================  ======================================
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["NULL_BLOCK", "canonical_layer", "chunk_descs", "group_kind", "identity_shape",
           "is_mla", "leading_identities", "mirror_shapes", "write_identities"]

_IDENTITY_BYTES = 32

#: vLLM's placeholder block (a windowed group's blocks out of the window); never
#: allocated to a request, never read
NULL_BLOCK = 0
_FULL = {"FullAttentionSpec", "MLAAttentionSpec"}
_WINDOW = {"SlidingWindowSpec", "ChunkedLocalAttentionSpec", "SlidingWindowMLASpec"}
_MLA = {"MLAAttentionSpec"}


def group_kind(spec: Any) -> Optional[str]:
    """``"full"`` or ``"window"`` for the KV cache spec of a group ems serves, None for
    one it does not (Mamba state, encoder-only, anything newer: by exact type, so a
    new subclass with other semantics is never served by mistake)."""
    name = type(spec).__name__
    if name in _FULL:
        return "full"
    if name in _WINDOW:
        return "window"
    return None


def is_mla(spec: Any) -> bool:
    """Whether a KV cache spec's layers are MLA's ``[blocks, block_size, dim]``: by exact
    type, as :func:`group_kind` (vLLM's ``MLAAttentionSpec``; a subclass such as its
    ``HiddenStateCacheSpec`` is another kind of cache, served by neither)."""
    return type(spec).__name__ in _MLA


def mirror_shapes(spec: Any, block_size: int, on_cpu: bool
                  ) -> tuple[list[tuple[int, ...]], Optional[int], bool]:
    """Per-layer per-block tensor shapes the worker registers (without dim 0), the
    opaque page size (or None for paged tensors), and whether it is MLA."""
    if is_mla(spec):
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


def chunk_descs(block_ids: list[list[int]], block_size: int) -> list[list[tuple[int, int]]]:
    """Per group, each block's whole page: ``(block * block_size, block_size)``."""
    return [[(b * block_size, block_size) for b in ids] for ids in block_ids]


def identity_shape(block_size: int) -> tuple[int, int]:
    """Per block, the identity page's shape (uint8): ``[block_size, w]`` holding at
    least 32 bytes, so it is a page of ``block_size`` token rows in paged layouts too."""
    return block_size, -(-_IDENTITY_BYTES // block_size)


def write_identities(pages: torch.Tensor, block_ids: list[int], digests: list[bytes]) -> None:
    """Write each block's digest into its identity page (the rest of the page 0)."""
    n = len(block_ids)
    if not n:
        return
    rows = torch.zeros((n, pages[0].numel()), dtype=torch.uint8)
    raw = torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8)
    rows[:, :_IDENTITY_BYTES] = raw.view(n, _IDENTITY_BYTES)
    ids = torch.tensor(block_ids, dtype=torch.long, device=pages.device)
    pages[ids] = rows.view(n, *pages.shape[1:]).to(pages.device)


def leading_identities(pages: torch.Tensor, block_ids: list[int], digests: list[bytes],
                       null_block: int = 0) -> int:
    """How many leading blocks' identity pages hold their expected digest (a block id
    ``null_block`` is not checked: nothing of it is ever read)."""
    n = len(block_ids)
    if not n:
        return 0
    ids = torch.tensor(block_ids, dtype=torch.long, device=pages.device)
    got = pages[ids].reshape(n, -1)[:, :_IDENTITY_BYTES].cpu()
    want = torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).view(n, -1)
    for i in range(n):
        if block_ids[i] != null_block and not torch.equal(got[i], want[i]):
            return i
    return n
