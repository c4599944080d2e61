"""bfloat16 linear layers on oneDNN's prepacked weight layout: the CPU path's matmuls.

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout on every call.
Reordering once when the engine starts measured 1.1-3.6x faster per matmul at 1-256 rows with SmolLM2-135M's
shapes (bf16, 2 AVX-512 cores; the LM head gains most, being the widest), with bit-identical results, for
about 80 ms of reordering per 200 MB of weights at start. float32 keeps ``F.linear``, whose arithmetic the
transformers comparison pins down, and quantized weights keep their own kernels.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from runtime.weights import ModelWeights

if TYPE_CHECKING:
    from runtime.weights import LinearWeight

LINEAR_FIELDS = ("qkv", "o_proj", "gate_up", "down")


class PackedWeight:
    """A [out_features, in_features] bf16 matrix in oneDNN's blocked layout; ``linear(x)`` is x @ W.T."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = (weight.shape[0], weight.shape[1])
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


def prepack_weights(weights: ModelWeights) -> ModelWeights:
    """The decoder's float linear layers and the head, packed; the embedding stays as it is (a lookup)."""

    def pack(w: LinearWeight) -> LinearWeight:
        return PackedWeight(w) if isinstance(w, torch.Tensor) else w

    layers = [
        replace(layer, **{f: pack(getattr(layer, f)) for f in LINEAR_FIELDS})  # type: ignore[arg-type]
        for layer in weights.layers
    ]
    return replace(weights, layers=layers, lm_head=pack(weights.lm_head))
