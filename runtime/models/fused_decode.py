"""A decode step's decoder layers in three calls each on the CPU: [RMSNorm, qkv, rotary, KV write] and [o_proj,
residual add + RMSNorm, gate_up, SiLU-and-mul, down, residual add] in C (runtime/kernels/cpu_gemv.c, one OpenMP
region each), decode attention between them as the ops run it (runtime/layers/attention.py's kernel path).

For one sequence on SmolLM2-135M about a third of a step was Python dispatch and small ops around the matmuls;
this path takes bf16 decode rows (at most MAX_ROWS) of plain or prepacked weights. It steps aside, for
the model's ordinary ops (the reference the tests compare with), for prefill rows, for a batch carrying LoRA
adapters, for quantized weights, for tensor-parallel shards, for q/k norms (Qwen3), for float32 (whose arithmetic
the transformers comparison pins down) and under ``WARMSTART_CPU_FUSED_DECODE=torch``.
"""

from __future__ import annotations

import os

import torch

from runtime.kernels import cpu_gemv
from runtime.layers.attention import AttentionMetadata
from runtime.layers.linear import plain_weight
from runtime.layers.ops import Ops
from runtime.layers.rotary import RotaryTables
from runtime.models.config import ModelConfig
from runtime.models.weights import LINEAR_FIELDS, ModelWeights

FUSED_ENV = "WARMSTART_CPU_FUSED_DECODE"
# The most decode rows the path takes. Its matmuls lose to oneDNN's above 2 rows (0.8x at 4: cpu_gemv.MAX_ROWS), but
# a step saves about 4 ms of dispatch at one row (benchmarks/decode.py: 18.8 against 23.0 ms/token unfused), more
# than the matmuls lose at 4; not measured at 3-4 rows.
MAX_ROWS = 4
FUSED_CHOICES = ("kernel", "torch")


class FusedDecode:
    """``enabled`` switches the path off in place (benchmarks/decode.py's reference rounds)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, rotary: RotaryTables) -> None:
        self.config = config
        self.weights = weights
        self.cos, self.sin = rotary.cos.contiguous(), rotary.sin.contiguous()
        self.enabled = True

    @classmethod
    def for_model(
        cls, config: ModelConfig, weights: ModelWeights, rotary: RotaryTables, sharded: bool
    ) -> FusedDecode | None:
        """The path for this model, or None where it never serves (see the module's docstring)."""
        choice = os.environ.get(FUSED_ENV) or "kernel"
        if choice not in FUSED_CHOICES:
            raise ValueError(f"{FUSED_ENV}={choice!r} is not one of {', '.join(FUSED_CHOICES)}")
        embed = weights.embed
        if choice != "kernel" or sharded or not cpu_gemv.gemv_serves(embed.device, embed.dtype):
            return None
        for layer in weights.layers:
            if layer.q_norm is not None or any(plain_weight(getattr(layer, f)) is None for f in LINEAR_FIELDS):
                return None
        return cls(config, weights, rotary)

    def serves(self, rows: int, meta: AttentionMetadata) -> bool:
        """Whether this step's batch takes the path: decode rows only, few of them. (The caller checks LoRA.)"""
        return self.enabled and 1 <= rows <= MAX_ROWS and all(g.is_decode for g in meta.groups)

    def layer(
        self, i: int, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
        meta: AttentionMetadata, ops: Ops,
    ) -> torch.Tensor:  # fmt: skip
        """Layer i over the residual stream x [rows, hidden]; positions and slots int64 [rows]."""
        c, layer = self.config, self.weights.layers[i]
        qkv, o_proj, gate_up, down = (plain_weight(getattr(layer, f)) for f in LINEAR_FIELDS)
        assert qkv is not None and o_proj is not None and gate_up is not None and down is not None
        eps = c.rms_norm_eps
        q = cpu_gemv.decode_attention_in(
            x, layer.input_norm, eps, qkv, layer.qkv_bias, self.cos, self.sin, positions, slots, cache, c.num_heads
        )
        # Decode groups read keys and values from the pool only (written above): q stands in for the new k, v.
        attn = ops.paged_attention(q, q, q, cache, meta, c.sliding_windows[i])
        return cpu_gemv.decode_mlp(attn.contiguous(), o_proj, x, layer.post_norm, eps, gate_up, down)
