"""RMSNorm in PyTorch, as transformers computes it: float32 inside, cast back to the input dtype, then the weight."""

from __future__ import annotations

import torch


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its root mean square, in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * _normalized(x, eps).to(x.dtype)


def rms_norm_weighted_in_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo 2's RMSNorm: the weight multiplies the float32 normalized values, and only the product is rounded."""
    return (weight * _normalized(x, eps)).to(x.dtype)


def rms_norm_offset_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the weight stored as its offset from 1, multiplied in float32, the product rounded once."""
    return (_normalized(x, eps) * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add rounds to the input dtype first."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed
