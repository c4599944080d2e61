"""A decode step's decoder layers in one C call on the CPU (runtime/kernels/cpu_gemv.c ``decode_layers``): every
layer's [RMSNorm, qkv, rotary, KV write], decode attention over the pool and [o_proj, residual add + RMSNorm,
gate_up, SiLU-and-mul, down, residual add] in one OpenMP region.

For one sequence on SmolLM2-135M about a third of a step was Python dispatch and small ops around the matmuls, and
three C calls per layer still left about 4 ms of it (docs/BENCHMARKS.md). This path takes bf16 decode rows
(at most MAX_ROWS) of plain or prepacked weights. It steps aside, for the model's ordinary ops (the reference the
tests compare with), for prefill rows, for a batch carrying LoRA adapters, for quantized weights, for tensor-parallel
shards, for q/k norms (Qwen3), for float32 (whose arithmetic the transformers comparison pins down), below AVX2 (the
gemv kernel's least: runtime/kernels/cpu_gemv.py), where the C decode attention does not serve the pool
(``WARMSTART_CPU_ATTENTION=torch``) and under ``WARMSTART_CPU_FUSED_DECODE=torch``.
"""

from __future__ import annotations

import torch

from warmstart.runtime.kernels import cpu_gemv
from warmstart.runtime.kernels.switches import kernel_chosen
from warmstart.runtime.layers.attention import AttentionMetadata, decode_kernel_serves
from warmstart.runtime.layers.linear import plain_weight
from warmstart.runtime.layers.rotary import RotaryTables
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.weights import LINEAR_FIELDS, ModelWeights

FUSED_ENV = "WARMSTART_CPU_FUSED_DECODE"
# The most decode rows the path takes: the kernel's most. A decode step of SmolLM2-135M against the ordinary ops
# (their linears on the same gemv kernel up to cpu_gemv.MAX_ROWS rows, oneDNN beyond; quiet probe): 1.34x faster at
# 1 row, 1.39x at 2, 1.64-1.85x at 3-4, 1.28x at 6, 1.42x at 8 (where the gemv alone is 0.88x oneDNN's).
MAX_ROWS = 8


class FusedDecode:
    """``enabled`` switches the path off in place (benchmarks/decode.py's reference rounds)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, rotary: RotaryTables) -> None:
        self.config = config
        self.weights = weights
        self.cos, self.sin = rotary.cos.contiguous(), rotary.sin.contiguous()
        self.enabled = True
        # the distinct attention windows; each layer's row of key_starts is its window's place here
        self.windows = list(dict.fromkeys(config.sliding_windows))
        self._table = torch.empty(0, dtype=torch.int64)
        # what the table was built from: the pool's addresses, and the plain weight tensors (kept, so that what the
        # table points at lives while it does; prepacking swaps them from a background thread)
        self._table_pool: list[int] = []
        self._table_weights: list[torch.Tensor | None] = []

    @classmethod
    def for_model(
        cls, config: ModelConfig, weights: ModelWeights, rotary: RotaryTables, sharded: bool
    ) -> FusedDecode | None:
        """The path for this model, or None where it never serves (see the module's docstring)."""
        embed = weights.embed
        if not kernel_chosen(FUSED_ENV) or sharded or not cpu_gemv.gemv_serves(embed.device, embed.dtype):
            return None
        c = config
        if c.head_dim % 2 or not decode_kernel_serves(embed.device, embed.dtype, c.num_heads // c.num_kv_heads,
                                                      c.head_dim):  # fmt: skip
            return None
        if (c.reordered_norms or c.sandwich_norms or c.activation != "silu" or c.embedding_multiplier != 1.0
                or c.moe is not None or c.rotary_dim != c.head_dim):
            return None
        for layer in weights.layers:
            if layer.q_norm is not None or any(plain_weight(getattr(layer, f)) is None for f in LINEAR_FIELDS):
                return None
        return cls(config, weights, rotary)

    def serves(self, rows: int, meta: AttentionMetadata) -> bool:
        """Whether this step's batch takes the path: decode rows only, few of them, in one group (the C attention's,
        rows in order). (The caller checks LoRA.)"""
        if not (self.enabled and 1 <= rows <= MAX_ROWS and len(meta.groups) == 1):
            return False
        group = meta.groups[0]
        return group.is_decode and group.block_tables.shape[0] == rows

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """Every layer over the residual stream x [rows, hidden] (its embeddings; updated in place and returned)."""
        self._call(x, positions, kv_caches, meta, None)
        return x

    def logits(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor | None:  # fmt: skip
        """``run``, then the final norm and the LM head in the same call: float32 logits of every row, as the
        model's ``_logits`` computes them (the same kernel, the same roundings); None where the head is not a plain
        bf16 matrix the kernel can read (nothing has run then)."""
        head = plain_weight(self.weights.lm_head)
        if head is None or head.dtype != torch.bfloat16 or not head.is_contiguous():
            return None
        return self._call(x, positions, kv_caches, meta, head)

    def _call(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
              head: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        c, group = self.config, meta.groups[0]
        starts = torch.stack([group.key_range(w)[0] for w in self.windows])
        ends = group.key_range(self.windows[0])[1]
        _, kv_heads, blocks, block_size, head_dim = kv_caches[0].shape
        return cpu_gemv.decode_layers(
            x, self._layer_table(kv_caches), self.cos, self.sin, positions.to(torch.int64).contiguous(),
            meta.slot_mapping.to(torch.int64).contiguous(), group.block_tables.to(torch.int64).contiguous(), starts,
            ends, c.num_heads, kv_heads, head_dim, c.intermediate_size, block_size, blocks * block_size * head_dim,
            c.rms_norm_eps, self.weights.norm if head is not None else None, head,
        )  # fmt: skip

    def _layer_table(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """[layers, cpu_gemv.LAYER_FIELDS], built again only when the pool's tensors or the plain weights change."""
        pool = [cache.data_ptr() for cache in kv_caches]
        weights = [plain_weight(getattr(layer, f)) for layer in self.weights.layers for f in LINEAR_FIELDS]
        if pool != self._table_pool or any(a is not b for a, b in zip(weights, self._table_weights, strict=False)):
            rows = []
            for i, layer in enumerate(self.weights.layers):
                qkv, o_proj, gate_up, down = weights[4 * i : 4 * i + 4]
                assert qkv is not None and o_proj is not None and gate_up is not None and down is not None
                assert layer.input_norm is not None  # for_model refuses reordered norms
                cache = kv_caches[i]
                assert cache.is_contiguous() and cache.dtype == torch.bfloat16
                bias = 0 if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
                rows.append([
                    layer.input_norm.data_ptr(), qkv.data_ptr(), bias, o_proj.data_ptr(), layer.post_norm.data_ptr(),
                    gate_up.data_ptr(), down.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(),
                    self.windows.index(self.config.sliding_windows[i]),
                ])  # fmt: skip
            self._table = torch.tensor(rows, dtype=torch.int64)
            self._table_pool, self._table_weights = pool, weights
        return self._table
