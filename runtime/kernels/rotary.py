"""Rotary embedding applied in place to q and k, from the model's precomputed cos/sin tables.

The tables (runtime.model.RotaryTables: [max_positions, head_dim], both halves equal, in the model dtype)
already carry every rope type's frequencies and scale (Llama 3, linear, YaRN), so the kernel has none to
know. The arithmetic is runtime.model.apply_rotary's: ``x * cos + rotate_half(x) * sin`` with each product
and the sum rounded to the model dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the kernels are then unavailable; runtime/layers' references still work
    HAVE_TRITON = False

from warmstart.runtime.kernels import require_triton

if HAVE_TRITON:

    @triton.jit
    def _rotate_heads(  # type: ignore[no-untyped-def]
        x_ptr, row_stride, token, cos1, sin1, cos2, sin2,
        HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HALF_PAD)[None, :]
        mask = (heads < HEADS) & (dims < HALF)
        first = x_ptr + token * row_stride + heads * 2 * HALF + dims
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        dt = x1.dtype
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        out1 = (a1 * cos1).to(dt).to(tl.float32) + (-a2 * sin1).to(dt).to(tl.float32)
        out2 = (a2 * cos2).to(dt).to(tl.float32) + (a1 * sin2).to(dt).to(tl.float32)
        tl.store(first, out1.to(dt), mask=mask)
        tl.store(first + HALF, out2.to(dt), mask=mask)

    @triton.jit
    def rotary_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, cos_ptr, sin_ptr, positions_ptr, q_row_stride, k_row_stride,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        row = tl.load(positions_ptr + token).to(tl.int64) * 2 * HALF
        dims = tl.arange(0, HALF_PAD)[None, :]
        mask = dims < HALF
        cos1 = tl.load(cos_ptr + row + dims, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + row + dims, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
        _rotate_heads(q_ptr, q_row_stride, token, cos1, sin1, cos2, sin2, HEADS, HEADS_PAD, HALF, HALF_PAD)
        _rotate_heads(k_ptr, k_row_stride, token, cos1, sin1, cos2, sin2, KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def rotary_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q: [N, heads, D] and k: [N, kv_heads, D] in place (rows may be strided views of a fused QKV
    projection; each token's heads contiguous) by the tables' rows at ``positions``; returns (q, k)."""
    require_triton(HAVE_TRITON)
    n, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim % 2 or cos.shape[1] != head_dim or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and tables {tuple(cos.shape)} disagree on head_dim")
    for x in (q, k):
        if x.stride()[1:] != (head_dim, 1):
            raise ValueError(f"rotary_ works in place: each token's heads must be contiguous, not {x.stride()}")
    half = head_dim // 2
    rotary_kernel[(n,)](
        q, k, cos.contiguous(), sin.contiguous(), positions, q.stride(0), k.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads), HALF=half, HALF_PAD=triton.next_power_of_2(half),
    )  # fmt: skip
    return q, k
