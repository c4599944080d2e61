"""A Mixture-of-Experts MLP over a flat batch of tokens (Qwen3-MoE, Mixtral), as transformers computes it: the
router's softmax in float32, each token's top-k experts (their probabilities renormalized where the family does),
each expert run once over the tokens routed to it, its outputs weighted and added in expert order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from warmstart.runtime.quant.formats import QuantizedExperts


@dataclass(frozen=True)
class Routing:
    top_k: int
    normalize: bool  # the top-k probabilities renormalized to sum to 1
    weights_in_model_dtype: bool  # the routing weights rounded to the model dtype (else float32)


def route(h: torch.Tensor, router: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's routing weights and experts, [N, top_k] each."""
    probs = F.linear(h, router).float().softmax(dim=-1)
    weights, experts = probs.topk(routing.top_k, dim=-1)
    if routing.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(h.dtype) if routing.weights_in_model_dtype else weights), experts


Experts = torch.Tensor | QuantizedExperts


def experts_mlp(
    h: torch.Tensor, router: torch.Tensor, gate_up: Experts, down: Experts, routing: Routing,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor], linear: Callable[[torch.Tensor, Any], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """h [N, hidden] through the experts: gate_up [experts, 2 * inter, hidden], down [experts, hidden, inter], float
    or each expert quantized; ``linear`` multiplies by one expert's matrix (the ops' linear, which knows both)."""
    weights, chosen = route(h, router, routing)
    out = torch.zeros_like(h)
    for e in chosen.unique().tolist():  # sorted: the sums run in transformers' order
        tokens, slot = (chosen == e).nonzero(as_tuple=True)
        y = linear(act_and_mul(linear(h[tokens], expert(gate_up, e))), expert(down, e))
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
    return out


def expert(w: Experts, e: int) -> Any:
    return w[e] if isinstance(w, torch.Tensor) else w.experts[e]
