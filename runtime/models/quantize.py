"""A model's weights quantized: the decoder's linear layers in one of runtime/quant's formats."""

from __future__ import annotations

from dataclasses import replace

import torch

from warmstart.runtime.models.weights import LINEAR_FIELDS, ModelWeights
from warmstart.runtime.quant.quantize import SCHEMES, check_fits, choose_group_size, quantize


def quantize_model(
    weights: ModelWeights, scheme: str, group_size: int | None = None, *, quantize_head: bool = False
) -> ModelWeights:
    """The decoder's linear layers (qkv, o_proj, gate_up, down) quantized; embedding, norms and biases stay float.

    The head stays float unless ``quantize_head``: its errors land on the logits unaveraged, and a tied head
    is the embedding itself, so a quantized head would be a second copy (see benchmarks/quant_quality.py).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "none":
        return weights
    if any(layer.experts_gate_up is not None for layer in weights.layers):
        raise ValueError("quantized experts are not supported yet; build a Mixture-of-Experts "
                         "model with --quant none")
    named = {f"layers.{i}.{f}": getattr(layer, f) for i, layer in enumerate(weights.layers) for f in LINEAR_FIELDS}
    if quantize_head:
        named["lm_head"] = weights.lm_head
    already = [n for n, w in named.items() if not isinstance(w, torch.Tensor)]
    if already:
        raise ValueError(f"{already[0]} is already quantized")
    shapes = {n: (w.shape[0], w.shape[1]) for n, w in named.items()}
    group_size = choose_group_size(scheme, group_size, list(shapes.values()))
    check_fits(shapes, scheme, group_size)
    q = {n: quantize(w, scheme, group_size, n) for n, w in named.items()}
    layers = [
        replace(layer, **{f: q[f"layers.{i}.{f}"] for f in LINEAR_FIELDS})  # type: ignore[arg-type]
        for i, layer in enumerate(weights.layers)
    ]
    return replace(weights, layers=layers, lm_head=q.get("lm_head", weights.lm_head))


