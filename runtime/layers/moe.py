"""A Mixture-of-Experts MLP over a flat batch of tokens (Qwen3-MoE, Mixtral), as transformers computes it: the
router's softmax in float32, each token's top-k experts (their probabilities renormalized where the family does),
each expert run once over the tokens routed to it, its outputs weighted and added in expert order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def experts_mlp(
    h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing: Routing,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """h [N, hidden] through the experts: gate_up [experts, 2 * inter, hidden], down [experts, hidden, inter]."""
    weights, chosen = route(h, router, routing)
    out = torch.zeros_like(h)
    for e in chosen.unique().tolist():  # sorted: the sums run in transformers' order
        tokens, slot = (chosen == e).nonzero(as_tuple=True)
        y = F.linear(act_and_mul(F.linear(h[tokens], gate_up[e])), down[e])
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
    return out
