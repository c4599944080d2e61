"""The decoder: one implementation for Llama, Mistral, Qwen2 and Qwen3, over a flat batch of tokens.

Every operation mirrors transformers' arithmetic (norms in float32, residuals in the model dtype, rotary
tables cast to the model dtype) so that float32 outputs match it to rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.layers.attention import AttentionMetadata
from runtime.models.config import ModelConfig, rope_inv_freq
from runtime.models.weights import ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTables:
    """cos/sin for every position up to ``max_positions``, computed once."""

    def __init__(
        self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        inv_freq, scale = rope_inv_freq(config)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, shaped to broadcast over heads: [N, 1, head_dim]."""
        return self.cos.index_select(0, positions)[:, None, :], self.sin.index_select(0, positions)[:, None, :]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Model:
    def __init__(self, config: ModelConfig, weights: ModelWeights, max_positions: int) -> None:
        self.config = config
        self.weights = weights
        self.dtype = weights.embed.dtype
        self.rotary = RotaryTables(config, max_positions, self.dtype, weights.embed.device)
        from runtime.layers.ops import select_ops  # runtime.layers.ops builds on this module's functions

        self.ops = select_ops(weights.embed.device, self.dtype, config)
        # Sums a row-parallel layer's partial outputs across tensor-parallel ranks (runtime/engine/tensor_parallel.py).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _unsharded
        # Joins vocabulary-split logits (each tensor-parallel rank computes its slice of the head).
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] = _unsharded

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the flat batch, write its K/V, and return float32 logits for the rows in ``logits_index``.

        ``inputs_embeds`` replaces the embedding lookup of ``input_ids`` (soft prompts, at build time)."""
        c, w, ops = self.config, self.weights, self.ops
        n = input_ids.shape[0]
        eps = c.rms_norm_eps
        x = F.embedding(input_ids, w.embed) if inputs_embeds is None else inputs_embeds
        rotary = ops.rotary_args(self.rotary, positions)
        for i, layer in enumerate(w.layers):
            h = ops.rms_norm(x, layer.input_norm, eps)
            qkv = ops.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.view(n, c.num_heads, c.head_dim)
            k = k.view(n, c.num_kv_heads, c.head_dim)
            v = v.view(n, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, eps)
                k = ops.rms_norm(k, layer.k_norm, eps)
            q, k = ops.rotary(q, k, rotary)
            ops.write_kv(kv_caches[i], k, v, meta.slot_mapping)
            attn = ops.paged_attention(q, k, v, kv_caches[i], meta, c.sliding_windows[i])
            h, x = ops.add_rms_norm(self.reduce(ops.linear(attn, layer.o_proj)), x, layer.post_norm, eps)
            x = x + self.reduce(ops.linear(ops.silu_and_mul(ops.linear(h, layer.gate_up)), layer.down))
        h = ops.rms_norm(x[logits_index], w.norm, eps)
        return self.gather_logits(ops.linear(h, w.lm_head).float())


def _unsharded(partial: torch.Tensor) -> torch.Tensor:
    return partial
