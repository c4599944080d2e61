"""Writing a step's new keys and values into the paged pool by slot (block * block_size + offset)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the kernels are then unavailable; runtime/layers' references still work
    HAVE_TRITON = False

from warmstart.runtime.kernels import require_triton
from warmstart.runtime.layers.attention import (
    write_kv as write_kv_reference,  # the engine's own PyTorch op is the reference
)

__all__ = ["write_kv", "write_kv_reference"]

if HAVE_TRITON:

    @triton.jit
    def write_kv_kernel(  # type: ignore[no-untyped-def]
        k_ptr, v_ptr, cache_ptr, slots_ptr, k_row_stride, v_row_stride, cache_kv_stride, cache_head_stride,
        KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        if slot >= 0:  # a negative slot is padding (a CUDA graph's unused rows)
            heads = tl.arange(0, HEADS_PAD).to(tl.int64)  # a large pool's offsets pass 2^31
            dims = tl.arange(0, D_PAD)
            mask = (heads < KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
            src = heads[:, None] * HEAD_DIM + dims[None, :]
            dst = heads[:, None] * cache_head_stride + slot * HEAD_DIM + dims[None, :]
            tl.store(cache_ptr + dst, tl.load(k_ptr + token * k_row_stride + src, mask=mask), mask=mask)
            tl.store(cache_ptr + cache_kv_stride + dst, tl.load(v_ptr + token * v_row_stride + src, mask=mask),
                     mask=mask)  # fmt: skip


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [2, kv_heads, num_blocks, block_size, head_dim]; k, v: [N, kv_heads, head_dim], rows may be strided
    (views of a fused QKV projection); slot_mapping: [N]."""
    require_triton(HAVE_TRITON)
    n, kv_heads, head_dim = k.shape
    if v.shape != k.shape or cache.shape[1] != kv_heads or cache.shape[4] != head_dim or not cache.is_contiguous():
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit a contiguous pool {tuple(cache.shape)}")
    if k.stride()[1:] != (head_dim, 1) or v.stride()[1:] != (head_dim, 1):
        k, v = k.contiguous(), v.contiguous()
    per_head = cache.shape[2] * cache.shape[3] * head_dim
    write_kv_kernel[(n,)](
        k, v, cache, slot_mapping, k.stride(0), v.stride(0), kv_heads * per_head, per_head,
        KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
