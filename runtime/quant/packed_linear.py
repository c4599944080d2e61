"""Linear layers on oneDNN's prepacked weight layout: the CPU path's matmuls of many rows (prefill).

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout on every call.
Reordering once when the engine starts measured 1.05-2.4x faster per matmul at 1-256 rows with SmolLM2-135M's
shapes (docs/BENCHMARKS.md, packed_linear; bf16, 2 AVX-512 cores; most at few rows), with bit-identical results, for
about 100 ms of reordering for SmolLM2-135M, done in the background after start.

A bf16 model packs bf16 where the CPU has AVX512-BF16's dot products (``packing_dtype`` in runtime/layers/linear.py
decides). Elsewhere oneDNN's bf16 matmul is emulated (on AVX2 it refuses to pack bf16 at all, and its plain bf16
matmul ran 2-4x slower than float32 there), so the packed copy is the bf16 weight widened to float32, exactly: x is
widened, multiplied in float32 and the result rounded once to bf16, as F.linear's bf16 matmul accumulates in float32
and rounds once; only the order of the sums differs. The widened copy costs twice the bf16 weights' memory. Until a
weight is packed (in the background after start) ``widened_linear`` computes with the plain one exactly as its packed
copy will, so that no output depends on how far the packing has got. float32 models keep ``F.linear``, whose
arithmetic the transformers comparison pins down, and quantized weights keep their own kernels.
"""

from __future__ import annotations

from typing import Any

import torch


class PackedWeight:
    """A [out_features, in_features] matrix in oneDNN's blocked layout, in ``compute`` (its own dtype by default);
    ``linear(x)`` is x @ W.T in x's dtype."""

    def __init__(self, weight: torch.Tensor, compute: torch.dtype | None = None) -> None:
        self.shape = (weight.shape[0], weight.shape[1])
        # Kept for the few-row kernel (runtime/kernels/cpu_gemv.py), which reads the plain layout: the mapped
        # snapshot tensor or the loaded one, or where that kernel serves their copy in huge pages (models/weights.py).
        self.weight = weight
        self.compute = compute or weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.compute).contiguous(), None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _onednn_linear(x, self.packed, bias, self.compute)

    def tensors(self) -> dict[str, torch.Tensor]:
        raise TypeError("packed weights exist only inside a running engine; store the weights before packing")

    def meta(self) -> dict[str, Any]:
        raise TypeError("packed weights exist only inside a running engine; store the weights before packing")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   compute: torch.dtype) -> torch.Tensor:
    # The bias goes inside the kernel, as with F.linear: added before the one rounding to x's dtype.
    if x.dtype == compute:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    wide_bias = bias.to(compute) if bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(x.to(compute), weight, wide_bias, "none", [], "").to(x.dtype)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T for a plain bf16 weight that packing widens, bit for bit what its packed copy gives: oneDNN's
    float32 matmul on the plain weight widened (measured identical to the packed layout's; F.linear's float32 is
    not)."""
    return _onednn_linear(x, weight.float(), bias, torch.float32)
