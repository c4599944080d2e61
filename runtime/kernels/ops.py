"""The decoder's operations on the Triton kernels (see runtime.layers.ops, which chooses between this and PyTorch).

Float weights still go through cuBLAS (F.linear); int8 and int4 weights through the quantized matmul kernel;
nf4 has no kernel here and keeps runtime.quant.formats's path.
"""

from __future__ import annotations

from typing import Any

import torch

from warmstart.runtime.kernels.activation import silu_and_mul
from warmstart.runtime.kernels.kv_cache import write_kv
from warmstart.runtime.kernels.lora import add_lora
from warmstart.runtime.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from warmstart.runtime.kernels.quant_matmul import quantized_linear
from warmstart.runtime.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from warmstart.runtime.kernels.rotary import rotary_
from warmstart.runtime.layers.attention import AttentionMetadata
from warmstart.runtime.layers.linear import LinearWeight, linear
from warmstart.runtime.layers.lora import LoraStep
from warmstart.runtime.layers.rotary import RotaryTables
from warmstart.runtime.quant.formats import Int4Weight, Int8Weight


class TritonOps:
    name = "triton"
    ragged_decode = True  # the decode kernel loops over each sequence's own blocks only

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def rotary_args(self, tables: RotaryTables, positions: torch.Tensor) -> Any:
        return tables.cos, tables.sin, positions.to(tables.cos.device)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin, positions = args
        return rotary_(q, k, cos, sin, positions)

    def write_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(cache, k, v, slot_mapping.to(cache.device))

    def paged_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
        window: int | None, scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The engine's attention groups, each one kernel launch: q [N, heads, D] -> [N, heads * D]."""
        n, heads, head_dim = q.shape
        out = q.new_empty(n, heads, head_dim)
        device = q.device
        for g in meta.groups:
            rows = g.rows.to(device) if isinstance(g.rows, torch.Tensor) else g.rows
            tables = g.block_tables.to(device=device, dtype=torch.int32)
            if g.is_decode:
                seq_lens = (g.query_positions + 1).to(device=device, dtype=torch.int32)
                o = paged_decode_attention(q[rows], cache, tables, seq_lens, g.first_key_position, window,
                                           scale=scale, softcap=softcap)
            else:  # one sequence's chunk, its queries the last of its positions
                t = len(g.query_positions)
                query_start = torch.tensor([0, t], dtype=torch.int32, device=device)
                seq_lens = torch.tensor([int(g.query_positions[-1]) + 1], dtype=torch.int32, device=device)
                first = g.first_key_position
                o = paged_prefill_attention(q[rows], cache, tables, query_start, seq_lens, first, window,
                                            scale=scale, softcap=softcap)
            out[rows] = o
        return out.view(n, heads * head_dim)

    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(w, Int8Weight | Int4Weight) or x.numel() == 0:
            return linear(x, w, bias)
        y = quantized_linear(x.reshape(-1, x.shape[-1]), w)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], w.shape[0])

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, step: LoraStep, layer: int, module: str) -> torch.Tensor:
        """Each row's LoRA adapter added to a fused linear's output (runtime/kernels/lora.py; Model picks this up)."""
        return add_lora(y, x, step, layer, module)
