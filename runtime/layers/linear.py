"""A linear layer over any of the engine's weight formats: float, quantized (runtime/quant/formats.py) or
oneDNN-prepacked (runtime/quant/packed_linear.py)."""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.nn.functional as F

from warmstart.runtime.kernels import isa
from warmstart.runtime.quant.formats import QuantizedWeight
from warmstart.runtime.quant.packed_linear import PackedWeight, widened_linear

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


def packing_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """What a model in ``dtype`` packs its weights as on this CPU (runtime/quant/packed_linear.py); None: it does not
    pack. bf16 itself only where the kernels' level has AVX512-BF16 and oneDNN packs bf16; float32 elsewhere."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    return torch.bfloat16 if isa.at_least("avx512_bf16") and isa.onednn_packs_bf16() else torch.float32


def widens(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (plain) is a bf16 one that packing widens to float32 here."""
    bf16 = weight.dtype == torch.bfloat16
    return bf16 and weight.device.type == "cpu" and packing_dtype(torch.bfloat16) == torch.float32
