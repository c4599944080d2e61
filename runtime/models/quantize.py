"""A model's weights quantized: the decoder's linear layers in one of runtime/quant's formats."""

from __future__ import annotations

from dataclasses import replace

import torch

from warmstart.runtime.models.weights import LINEAR_FIELDS, ModelWeights
from warmstart.runtime.quant.formats import QuantizedExperts, QuantizedWeight
from warmstart.runtime.quant.quantize import SCHEMES, check_fits, choose_group_size, quantize

EXPERT_FIELDS = ("experts_gate_up", "experts_down")  # a layer of experts' matrices: each expert quantized alone


def quantize_model(
    weights: ModelWeights, scheme: str, group_size: int | None = None, *, quantize_head: bool = False
) -> ModelWeights:
    """The decoder's linear layers (qkv, o_proj, gate_up, down, or a layer's experts) quantized; embedding, norms,
    biases and the experts' routers stay float.

    The head stays float unless ``quantize_head``: its errors land on the logits unaveraged, and a tied head
    is the embedding itself, so a quantized head would be a second copy (see benchmarks/quant_quality.py).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "none":
        return weights
    named = {f"layers.{i}.{f}": getattr(layer, f) for i, layer in enumerate(weights.layers) for f in LINEAR_FIELDS
             if getattr(layer, f) is not None}  # fmt: skip
    experts = {f"layers.{i}.{f}": getattr(layer, f) for i, layer in enumerate(weights.layers) for f in EXPERT_FIELDS
               if getattr(layer, f) is not None}  # fmt: skip
    if quantize_head:
        named["lm_head"] = weights.lm_head
    already = [n for n, w in {**named, **experts}.items() if not isinstance(w, torch.Tensor)]
    if already:
        raise ValueError(f"{already[0]} is already quantized")
    shapes = {n: (w.shape[0], w.shape[1]) for n, w in named.items()}
    shapes.update({f"{n}[0]": (w.shape[1], w.shape[2]) for n, w in experts.items()})  # every expert's is alike
    group_size = choose_group_size(scheme, group_size, list(shapes.values()))
    check_fits(shapes, scheme, group_size)
    q = {n: quantize(w, scheme, group_size, n) for n, w in named.items()}
    q.update({n: QuantizedExperts([_quantized(w[e], scheme, group_size, f"{n}[{e}]") for e in range(w.shape[0])])
              for n, w in experts.items()})  # fmt: skip
    layers = [
        replace(layer, **{f: q[f"layers.{i}.{f}"] for f in (*LINEAR_FIELDS, *EXPERT_FIELDS)  # type: ignore[arg-type]
                          if f"layers.{i}.{f}" in q})
        for i, layer in enumerate(weights.layers)
    ]
    return replace(weights, layers=layers, lm_head=q.get("lm_head", weights.lm_head))


def _quantized(w: torch.Tensor, scheme: str, group_size: int, name: str) -> QuantizedWeight:
    q = quantize(w, scheme, group_size, name)
    assert isinstance(q, QuantizedWeight)  # a scheme other than none
    return q
