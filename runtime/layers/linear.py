"""A linear layer over any of the engine's weight formats: float, quantized (runtime/quant/formats.py) or
oneDNN-prepacked (runtime/quant/packed_linear.py)."""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.nn.functional as F

from runtime.quant.formats import QuantizedWeight
from runtime.quant.packed_linear import PackedWeight, widened_linear, widens

LinearWeight: TypeAlias = torch.Tensor | QuantizedWeight | PackedWeight


def linear(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a float weight (bit for bit), the weight's own kernel for a quantized or packed one. A plain bf16
    weight that packing will widen to float32 computes as its packed copy will (runtime/quant/packed_linear.py)."""
    if isinstance(w, torch.Tensor):
        return widened_linear(x, w, bias) if widens(w) else F.linear(x, w, bias)
    if isinstance(w, PackedWeight):
        return w.linear(x, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = w.linear(x2) if x2.shape[0] else x2.new_empty(0, w.shape[0])
    if bias is not None:
        y = y + bias
    return y.view(*lead, w.shape[0])


def plain_weight(w: LinearWeight) -> torch.Tensor | None:
    """The row-major [out_features, in_features] tensor behind a float or prepacked weight; None for a quantized one."""
    if isinstance(w, torch.Tensor):
        return w
    if isinstance(w, PackedWeight):
        return w.weight
    return None
