"""bfloat16 linear layers on oneDNN's prepacked weight layout: the CPU path's matmuls.

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout on every call.
Reordering once when the engine starts measured 1.05-2.4x faster per matmul at 1-256 rows with SmolLM2-135M's
shapes (benchmarks/packed_linear.py; bf16, 2 AVX-512 cores; most at few rows), with bit-identical results, for
about 100 ms of reordering for SmolLM2-135M, done in the background after start. float32 keeps ``F.linear``,
whose arithmetic the transformers comparison pins down, and quantized weights keep their own kernels.
"""

from __future__ import annotations

from typing import Any

import torch


class PackedWeight:
    """A [out_features, in_features] bf16 matrix in oneDNN's blocked layout; ``linear(x)`` is x @ W.T."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = (weight.shape[0], weight.shape[1])
        # Kept for the few-row kernel (runtime/kernels/cpu_gemv.py), which reads the plain layout: the mapped
        # snapshot tensor or the loaded one, or where that kernel serves their copy in huge pages (models/weights.py).
        self.weight = weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # The bias goes inside the kernel, as with F.linear: added before the one rounding to bf16.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def tensors(self) -> dict[str, torch.Tensor]:
        raise TypeError("packed weights exist only inside a running engine; store the weights before packing")

    def meta(self) -> dict[str, Any]:
        raise TypeError("packed weights exist only inside a running engine; store the weights before packing")


def can_prepack(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
