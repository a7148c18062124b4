"""A small Llama-style decoder with a paged KV cache, for the ``ems demo``.

The architecture is the one of Llama 2/3 and most open models: RMSNorm, rotary
position embeddings, grouped-query attention and a SwiGLU MLP, pre-norm residual
blocks, an untied LM head. The weights are **random**, drawn from a fixed seed:
this machine has no model hub to download from, and prefix caching does not care
what the weights mean, only that the KV a later request loads is the KV it would
have computed. The model runs in float32 on the CPU so that outputs with and
without the cache can be compared with a tight tolerance.

The KV cache is paged the way vLLM pages it: per layer one K and one V tensor of
shape ``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence owns a list
of block ids (its *block table*); token ``t`` of the sequence lives in slot
``block_table[t // block_size] * block_size + t % block_size``. A forward step
writes the new tokens' K/V into their slots, then gathers the whole context back
through the block table and attends over it, so the step cannot tell whether
earlier slots were computed by this process or loaded from the pool.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["ModelConfig", "LlamaModel"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the demo model; every field has a default sized for two CPU cores."""

    vocab_size: int = 4096
    """Number of token ids (ids are drawn uniformly by the workload)."""
    hidden_size: int = 256
    """Width of the residual stream."""
    num_layers: int = 4
    """Decoder layers; each one owns a K and a V cache tensor."""
    num_heads: int = 8
    """Query heads; ``hidden_size`` must be a multiple."""
    num_kv_heads: int = 2
    """K/V heads (grouped-query attention); ``num_heads`` must be a multiple."""
    intermediate_size: int = 0
    """SwiGLU width; 0 picks Llama's ``8/3 * hidden`` rounded up to 64."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rms_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    seed: int = 0
    """Seed of the random weights."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (rotary embeddings)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """The SwiGLU width actually used."""
        if self.intermediate_size > 0:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers (float32)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def for_hidden(cls, hidden_size: int, **overrides: int) -> "ModelConfig":
        """A config whose head counts follow ``hidden_size`` the usual way.

        head_dim is 32 below hidden 512 and 64 from there (128 from 2048), and
        there are a quarter as many K/V heads as query heads (at least one).
        """
        head_dim = 32 if hidden_size < 512 else 64 if hidden_size < 2048 else 128
        heads = overrides.pop("num_heads", 0) or max(1, hidden_size // head_dim)
        kv_heads = overrides.pop("num_kv_heads", 0) or max(1, heads // 4)
        return cls(hidden_size=hidden_size, num_heads=heads, num_kv_heads=kv_heads,
                   **overrides)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaModel:
    """The decoder: random weights, a paged forward and a dense reference forward.

    Plain tensors rather than ``nn.Module``: nothing is trained, and the whole
    forward fits on one screen. Everything runs under ``torch.inference_mode``.
    """

    def __init__(self, config: ModelConfig, device: str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        c = config

        def normal(*shape: int, std: float) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32) * std
            return w.to(self.device)

        h, hd, ffn = c.hidden_size, c.head_dim, c.ffn_size
        out_std = 1.0 / math.sqrt(2 * c.num_layers)
        self.embed = normal(c.vocab_size, h, std=1.0)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(c.num_layers):
            self.layers.append({
                "attn_norm": torch.ones(h, device=self.device),
                # q, k, v fused as one matrix: one GEMM per layer.
                "wqkv": normal((c.num_heads + 2 * c.num_kv_heads) * hd, h, std=h ** -0.5),
                "wo": normal(h, c.num_heads * hd, std=out_std * (c.num_heads * hd) ** -0.5),
                "mlp_norm": torch.ones(h, device=self.device),
                "w_gate_up": normal(2 * ffn, h, std=h ** -0.5),
                "w_down": normal(h, ffn, std=out_std * ffn ** -0.5),
            })
        self.final_norm = torch.ones(h, device=self.device)
        # Logits of std ~2: greedy choices are clear-cut, not decided by rounding.
        self.lm_head = normal(c.vocab_size, h, std=2.0 * h ** -0.5)
        self.inv_freq = 1.0 / (c.rope_theta ** (
            torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd))

    # ------------------------------------------------------------------ cache

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[list[torch.Tensor]]:
        """Per layer ``[k, v]``, each ``[num_blocks, block_size, kv_heads, head_dim]``.

        This is the ``kv_caches`` argument of ``cc.register_kvcache``.
        """
        c = self.config
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        return [[torch.zeros(shape, dtype=torch.float32, device=self.device)
                 for _ in range(2)] for _ in range(c.num_layers)]

    # ---------------------------------------------------------------- forward

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, head_dim]`` by the angles of ``positions``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return x * emb.cos() + _rotate_half(x) * emb.sin()

    def _qkv(self, layer: dict[str, torch.Tensor], x: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        h = _rms_norm(x, layer["attn_norm"], c.rms_eps)
        qkv = h @ layer["wqkv"].T
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                             c.num_kv_heads * c.head_dim], dim=-1)
        q = self._rope(q.view(-1, c.num_heads, c.head_dim), positions)
        k = self._rope(k.view(-1, c.num_kv_heads, c.head_dim), positions)
        return q, k, v.view(-1, c.num_kv_heads, c.head_dim)

    def _finish_layer(self, layer: dict[str, torch.Tensor], x: torch.Tensor,
                      attn: torch.Tensor) -> torch.Tensor:
        """``attn`` ``[heads, T, head_dim]`` -> output projection, residual, MLP."""
        c = self.config
        x = x + attn.transpose(0, 1).reshape(x.shape[0], -1) @ layer["wo"].T
        gate, up = (_rms_norm(x, layer["mlp_norm"], c.rms_eps)
                    @ layer["w_gate_up"].T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ layer["w_down"].T

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.final_norm, self.config.rms_eps) @ self.lm_head.T

    @torch.inference_mode()
    def forward_paged(self, token_ids: torch.Tensor, start_pos: int,
                      block_table: torch.Tensor, kv_caches: list[list[torch.Tensor]]
                      ) -> torch.Tensor:
        """Run tokens ``[start_pos, start_pos + T)`` of one sequence; logits of the last.

        ``token_ids`` (int64, ``[T]``) are the new tokens; positions before
        ``start_pos`` must already be in the cache (computed earlier, or loaded).
        ``block_table`` (int64) holds the sequence's block ids and must cover
        ``start_pos + T`` tokens. The new tokens' K/V are written into their slots,
        then each query attends causally over the whole context gathered from the
        cache. Returns the float32 logits ``[vocab]`` of the last new token.
        """
        c = self.config
        num_new = token_ids.shape[0]
        context_len = start_pos + num_new
        block_size = kv_caches[0][0].shape[1]
        if block_table.shape[0] * block_size < context_len:
            raise ValueError(f"block table of {block_table.shape[0]} blocks cannot hold "
                             f"{context_len} tokens")
        positions = torch.arange(start_pos, context_len, device=self.device)
        slots = block_table[positions // block_size] * block_size + positions % block_size
        used_blocks = block_table[: -(-context_len // block_size)]
        if num_new == 1:
            mask = None  # a decode step sees the whole context
        else:
            key_pos = torch.arange(context_len, device=self.device)
            mask = key_pos[None, :] <= positions[:, None]
        x = self.embed[token_ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            q, k, v = self._qkv(layer, x, positions)
            k_cache.view(-1, c.num_kv_heads, c.head_dim)[slots] = k
            v_cache.view(-1, c.num_kv_heads, c.head_dim)[slots] = v
            keys = k_cache[used_blocks].flatten(0, 1)[:context_len]
            values = v_cache[used_blocks].flatten(0, 1)[:context_len]
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, enable_gqa=True)
            x = self._finish_layer(layer, x, attn)
        return self._logits(x[-1])

    @torch.inference_mode()
    def forward_dense(self, token_ids: torch.Tensor,
                      last: Optional[int] = None) -> torch.Tensor:
        """Reference forward without any cache: logits ``[T, vocab]`` of every token.

        Plain causal attention with K/V heads repeated for the query groups, so it
        shares no attention code with :meth:`forward_paged` (tests compare them).
        ``last`` keeps only the logits of the last ``last`` tokens.
        """
        c = self.config
        positions = torch.arange(token_ids.shape[0], device=self.device)
        x = self.embed[token_ids]
        groups = c.num_heads // c.num_kv_heads
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, positions)
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
            causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool,
                                device=self.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            attn = torch.einsum("hqk,khd->hqd", probs, v)
            x = self._finish_layer(layer, x, attn)
        if last is not None:
            x = x[-last:]
        return self._logits(x)
