"""The decoder: one implementation for Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2 and Gemma 3, over a flat batch
of tokens.

Every operation mirrors transformers' arithmetic (norms in float32, residuals in the model dtype, rotary
tables cast to the model dtype; OLMo 2 keeps its norm weights' products and its rotary in float32, Gemma 3 its norm
weights' products) so that float32 outputs match it to rounding. Where the norms sit differs by family: before
each block (Llama), after each block (OLMo 2's reordered norms), or both (Gemma 3's sandwich norms).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from warmstart.runtime.kernels import cpu_lora
from warmstart.runtime.layers import lora as torch_lora
from warmstart.runtime.layers.attention import AttentionMetadata
from warmstart.runtime.layers.lora import LoraStep
from warmstart.runtime.layers.moe import Routing, experts_mlp
from warmstart.runtime.layers.norm import rms_norm_offset_weight, rms_norm_weighted_in_float32
from warmstart.runtime.layers.ops import select_ops
from warmstart.runtime.layers.rotary import RotaryTables, apply_rotary
from warmstart.runtime.models.config import ModelConfig, rope_inv_freq
from warmstart.runtime.models.fused_decode import FusedDecode
from warmstart.runtime.models.weights import ModelWeights

Collective = Callable[[torch.Tensor], torch.Tensor]


class Model:
    """``reduce`` sums a row-parallel layer's partial outputs across tensor-parallel ranks, ``gather_logits``
    joins vocabulary-split logits (each rank computes its slice of the head); both are the identity unless
    the model is one rank's shard (runtime/engine/tensor_parallel.py)."""

    def __init__(
        self, config: ModelConfig, weights: ModelWeights, max_positions: int,
        reduce: Collective | None = None, gather_logits: Collective | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.weights = weights
        self.dtype = weights.embed.dtype
        device = self.device = weights.embed.device
        self.reordered = config.reordered_norms
        rotary_dtype = torch.float32 if self.reordered else self.dtype
        self.partial_rotary = config.rotary_dim < config.head_dim  # rotated in PyTorch: the ops rotate whole heads
        self.rotary = RotaryTables(*rope_inv_freq(config), max_positions, rotary_dtype, device)
        # Gemma 3's sliding-window layers rotate with plain rope of their own base
        self.local_rotary = None if config.local_rope_theta is None else RotaryTables(
            *rope_inv_freq(replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)), max_positions,
            rotary_dtype, device)
        self.sandwich = config.sandwich_norms
        self.act_and_mul = gelu_tanh_and_mul if config.activation == "gelu_tanh" else None
        moe = config.moe
        self.routing = None if moe is None else Routing(moe.top_k, moe.normalize, moe.weights_in_model_dtype)
        self.ops = select_ops(device, self.dtype, (config.num_heads // config.num_kv_heads, config.head_dim))
        self.reduce: Collective = reduce or _unsharded
        self.gather_logits: Collective = gather_logits or _unsharded
        self.sharded = reduce is not None or gather_logits is not None  # one rank's part of the model
        # Past the last layer's KV write only the rows whose logits a step wants go on (off: benchmarks/prefill.py's
        # warmstart-all-rows, which measures it)
        self.wanted_rows_only = True
        # bf16 decode rows on the CPU: every layer in one C call (runtime/models/fused_decode.py), or None
        self.fused_decode = FusedDecode.for_model(config, weights, self.rotary, self.sharded)
        # The LoRA add is an op of its own: layers/ops.py's Ops has none, so the kernels' TritonOps may offer one;
        # bf16 on the CPU takes the C kernel (runtime/kernels/cpu_lora.py) where it serves.
        self.add_lora: Callable[..., torch.Tensor] = getattr(self.ops, "add_lora", None) or (
            cpu_lora.add_lora if cpu_lora.lora_kernel_serves(device, self.dtype) else torch_lora.add_lora
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        lora: LoraStep | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Run the flat batch, write its K/V, and return float32 logits for the rows in ``logits_index`` (with
        ``hidden``: their final hidden states, after the final norm, which embeddings pool).

        ``inputs_embeds`` replaces the embedding lookup of ``input_ids`` (soft prompts, at build time); ``lora``
        adds each row's LoRA adapter after the four fused linears (runtime/layers/lora.py)."""
        # Triton launches a kernel on the calling thread's current CUDA device, whatever device its tensors are
        # on, and the threads that step the engine never chose one (so cuda:0): make the model's current here.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            return self._forward(input_ids, positions, kv_caches, meta, logits_index, inputs_embeds, lora, hidden)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        lora: LoraStep | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        c, w, ops = self.config, self.weights, self.ops

        def linear(x: torch.Tensor, i: int, module: str, bias: torch.Tensor | None = None) -> torch.Tensor:
            y = ops.linear(x, getattr(w.layers[i], module), bias)
            return y if lora is None else self.add_lora(y, x, lora, i, module)

        n = input_ids.shape[0]
        eps = c.rms_norm_eps
        x = F.embedding(input_ids, w.embed) if inputs_embeds is None else inputs_embeds
        if inputs_embeds is None and c.embedding_multiplier != 1.0:  # Gemma's, rounded to the dtype as its own
            x = x * torch.tensor(c.embedding_multiplier).to(x.dtype)
        fused = (self.fused_decode if not hidden and lora is None and self.fused_decode
                 and self.fused_decode.serves(n, meta) else None)
        if fused is not None:
            if logits_index.numel() == n:  # every row's logits, in order (a decode row has one at most)
                logits = fused.logits(x.contiguous(), positions, kv_caches, meta)
                if logits is not None:
                    return logits
            return self._logits(fused.run(x.contiguous(), positions, kv_caches, meta), logits_index)
        own_rotary = self.reordered or self.partial_rotary
        rotary = self.rotary.lookup(positions) if own_rotary else ops.rotary_args(self.rotary, positions)
        local = None if self.local_rotary is None else ops.rotary_args(self.local_rotary, positions)
        last = len(w.layers) - 1
        rows: torch.Tensor | None = logits_index
        for i, layer in enumerate(w.layers):
            h = x if layer.input_norm is None else self.norm(x, layer.input_norm)
            qkv = linear(h, i, "qkv", layer.qkv_bias)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            if self.reordered and layer.q_norm is not None and layer.k_norm is not None:  # over all heads at once
                q, k = self.norm(q, layer.q_norm), self.norm(k, layer.k_norm)
            q = q.view(n, c.num_heads, c.head_dim)
            k = k.view(n, c.num_kv_heads, c.head_dim)
            v = v.view(n, c.num_kv_heads, c.head_dim)
            if not self.reordered and layer.q_norm is not None and layer.k_norm is not None:  # per head
                q, k = self.norm(q, layer.q_norm), self.norm(k, layer.k_norm)
            window = c.sliding_windows[i]
            q, k = self.rotate(q, k, local if local is not None and window is not None else rotary)
            ops.write_kv(kv_caches[i], k, v, meta.slot_mapping)
            attn = ops.paged_attention(q, k, v, kv_caches[i], meta, window, c.attention_scale, c.attention_softcap)
            if i == last and self.wanted_rows_only and lora is None and not self.sharded and logits_index.numel() < n:
                # The last layer's KV is written; past this point a row feeds nothing but its logits, so only the
                # rows whose logits are wanted go on (a prompt's last token; none for a chunk before its last).
                # Not for a LoRA step (its rows map to adapters) or a tensor-parallel shard (ranks that see another
                # logits_index would all-reduce tensors of other sizes).
                attn, x, rows = attn[logits_index], x[logits_index], None
            if layer.mlp_out_norm is not None:  # reordered or sandwich: each block's output normalized, then added
                x = x + self.norm(self.reduce(linear(attn, i, "o_proj")), layer.post_norm)
                h = x if layer.mlp_in_norm is None else self.norm(x, layer.mlp_in_norm)
                x = x + self.norm(self._mlp(h, i, linear), layer.mlp_out_norm)
            else:
                h, x = ops.add_rms_norm(self.reduce(linear(attn, i, "o_proj")), x, layer.post_norm, eps)
                x = x + self._mlp(h, i, linear)
        if hidden:
            return self.norm(x if rows is None else x[rows], w.norm).float()
        return self._logits(x, rows)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rotary: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k at their positions (``rotary``: the step's rotary arguments); OLMo 2's in float32 (its tables'
        dtype), rounded once; with a partial rotary only the leading rotary_dim dimensions of each head."""
        if self.partial_rotary:
            d = self.config.rotary_dim
            q_rot, k_rot = apply_rotary(q[..., :d], k[..., :d], *rotary)
            return torch.cat([q_rot, q[..., d:]], dim=-1), torch.cat([k_rot, k[..., d:]], dim=-1)
        if not self.reordered:
            return self.ops.rotary(q, k, rotary)
        q32, k32 = apply_rotary(q, k, *rotary)
        return q32.to(q.dtype), k32.to(k.dtype)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm (OLMo 2's multiplies the weight in float32, Gemma's 1 + the weight)."""
        if self.reordered:
            return rms_norm_weighted_in_float32(x, weight, self.config.rms_norm_eps)
        if self.sandwich:
            return rms_norm_offset_weight(x, weight, self.config.rms_norm_eps)
        return self.ops.rms_norm(x, weight, self.config.rms_norm_eps)

    def _mlp(self, h: torch.Tensor, i: int, linear: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Layer i's MLP: dense (gate_up, the activation, down), or its experts."""
        layer = self.weights.layers[i]
        if layer.router is not None and layer.experts_gate_up is not None and layer.experts_down is not None:
            assert self.routing is not None
            return experts_mlp(h, layer.router, layer.experts_gate_up, layer.experts_down, self.routing, self.gate,
                               self.ops.linear)
        return self.reduce(linear(self.gate(linear(h, i, "gate_up")), i, "down"))

    def gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's activated gate times up, from their fused output."""
        return self.ops.silu_and_mul(gate_up) if self.act_and_mul is None else self.act_and_mul(gate_up)

    def _logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Float32 logits of x's ``rows`` (None: every row)."""
        h = self.norm(x if rows is None else x[rows], self.weights.norm)
        logits = self.gather_logits(self.ops.linear(h, self.weights.lm_head).float())
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu with the tanh approximation of the gate's half, times the up half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _unsharded(partial: torch.Tensor) -> torch.Tensor:
    return partial
