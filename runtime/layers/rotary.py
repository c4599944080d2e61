"""Rotary position embeddings: cos/sin tables computed once, applied to queries and keys by position."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTables:
    """cos/sin for every position up to ``max_positions``, computed once from the inverse frequencies and the
    cos/sin scale of the model's rope type (runtime.models.config.rope_inv_freq)."""

    def __init__(
        self, inv_freq: torch.Tensor, scale: float, max_positions: int, dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:  # fmt: skip
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, shaped to broadcast over heads: [N, 1, head_dim]."""
        return lookup(self.cos, self.sin, positions)


def lookup(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the cos and sin tables at ``positions``, shaped to broadcast over heads: [N, 1, head_dim]."""
    return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
