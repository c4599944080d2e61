"""LoRA over a flat batch of many adapters' rows on the CUDA path: Punica-style segmented shrink and expand.

The layout is runtime/layers/lora.py's (the PyTorch reference this is tested against): the rows carrying an
adapter, sorted by slot and cut into tiles of one adapter each, and the resident adapters stacked in slots,
Aᵀ [slots, in, slices, max_rank], Bᵀ [slots, max_rank, out] (output columns of slice s read slice s's rank
columns of the shrunk product). Two kernels, one launch each per linear:

- shrink: a program per tile computes ``x[rows] @ A[slot]ᵀ`` for the tile's rows, BLOCK_M at a time, into a
  float32 [rows, slices * rank] buffer (in ``rows`` order);
- expand: a program per (tile, BLOCK_N output columns) loads its B tile once and adds ``shrunk @ B[slot]ᵀ`` to
  the base output's rows. Rows never repeat, so no two programs write the same element.

Only the step's rank (the largest of its adapters) is computed, and rows without an adapter cost nothing.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from warmstart.runtime.kernels.dot import dot

    HAVE_TRITON = True
except ImportError:  # the kernels are then unavailable; runtime/layers' references still work
    HAVE_TRITON = False

from warmstart.runtime.kernels import require_triton
from warmstart.runtime.layers.lora import LoraStep

BLOCK_M = 16  # tl.dot's minimum
BLOCK_IN = 64
BLOCK_N = 64

if HAVE_TRITON:

    @triton.jit
    def lora_shrink_kernel(  # type: ignore[no-untyped-def]
        x_ptr, x_stride, rows_ptr, tile_starts_ptr, tile_ends_ptr, tile_slots_ptr, a_ptr, out_ptr,
        fan_in, rank, max_rank, num_slices,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_IN: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        start = tl.load(tile_starts_ptr + tile)
        end = tl.load(tile_ends_ptr + tile)
        slot = tl.load(tile_slots_ptr + tile).to(tl.int64)
        width = num_slices * rank
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < width
        # column k of the slot's Aᵀ at this rank: slice k // rank, rank row k % rank
        a_cols = slot * fan_in * num_slices * max_rank + (ks // rank) * max_rank + ks % rank
        for m0 in range(start, end, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            m_ok = m < end
            rows = tl.load(rows_ptr + m, mask=m_ok, other=0)
            acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for i0 in range(0, fan_in, BLOCK_IN):
                i = i0 + tl.arange(0, BLOCK_IN)
                i_ok = i < fan_in
                x = tl.load(x_ptr + rows[:, None] * x_stride + i[None, :], mask=m_ok[:, None] & i_ok[None, :],
                            other=0.0)
                a = tl.load(a_ptr + a_cols[None, :] + i[:, None] * num_slices * max_rank,
                            mask=i_ok[:, None] & k_ok[None, :], other=0.0)
                acc += dot(x, a)
            tl.store(out_ptr + m[:, None] * width + ks[None, :], acc, mask=m_ok[:, None] & k_ok[None, :])

    @triton.jit
    def lora_expand_kernel(  # type: ignore[no-untyped-def]
        shrunk_ptr, rows_ptr, tile_starts_ptr, tile_ends_ptr, tile_slots_ptr, b_ptr, y_ptr, y_stride,
        out_features, rank, max_rank, end0, end1,
        NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """``end0``, ``end1``: where the first and second slices' output columns end (unused ones: out)."""
        tile = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < out_features
        start = tl.load(tile_starts_ptr + tile)
        end = tl.load(tile_ends_ptr + tile)
        slot = tl.load(tile_slots_ptr + tile).to(tl.int64)
        width = NUM_SLICES * rank
        qs = tl.arange(0, BLOCK_R)
        q_ok = qs < rank
        b_offsets = slot * max_rank * out_features + qs[:, None] * out_features + n[None, :]
        b = tl.load(b_ptr + b_offsets, mask=q_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        slice_of = (n >= end0).to(tl.int32) + (n >= end1).to(tl.int32)  # each column's slice
        for m0 in range(start, end, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            m_ok = m < end
            rows = tl.load(rows_ptr + m, mask=m_ok, other=0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(NUM_SLICES):  # a block of columns may hold two slices' ends
                part = tl.load(shrunk_ptr + m[:, None] * width + s * rank + qs[None, :],
                               mask=m_ok[:, None] & q_ok[None, :], other=0.0)
                acc += dot(part, tl.where((slice_of == s)[None, :], b, 0.0))
            mask = m_ok[:, None] & n_ok[None, :]
            y_offsets = rows[:, None] * y_stride + n[None, :]
            y = tl.load(y_ptr + y_offsets, mask=mask, other=0.0)
            tl.store(y_ptr + y_offsets, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def add_lora(y: torch.Tensor, x: torch.Tensor, step: LoraStep, layer: int, module: str) -> torch.Tensor:
    """runtime.layers.lora.add_lora on the kernels: ``y`` [n, out] plus each row's adapter's B @ A @ x, in place."""
    require_triton(HAVE_TRITON)
    if module not in step.modules:
        return y
    a, b = step.slots.a[layer][module], step.slots.b[layer][module]
    _, fan_in, slices, max_rank = a.shape
    out_features = b.shape[2]
    outs = step.slots.out_slices[module]
    ends = [sum(outs[: s + 1]) for s in range(len(outs))] + [out_features] * 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert y.dim() == 2 and y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    width = slices * step.rank
    block_k = max(16, triton.next_power_of_2(width))
    shrunk = torch.empty(step.rows.shape[0], width, dtype=torch.float32, device=x.device)
    tiles = step.num_tiles
    lora_shrink_kernel[(tiles,)](
        x, x.stride(0), step.rows, step.tile_starts, step.tile_ends, step.tile_slots, a, shrunk,
        fan_in, step.rank, max_rank, slices, BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_IN=BLOCK_IN,
    )  # fmt: skip
    lora_expand_kernel[(tiles, triton.cdiv(out_features, BLOCK_N))](
        shrunk, step.rows, step.tile_starts, step.tile_ends, step.tile_slots, b, y, y.stride(0),
        out_features, step.rank, max_rank, ends[0], ends[1], NUM_SLICES=slices, BLOCK_M=BLOCK_M,
        BLOCK_R=max(16, triton.next_power_of_2(step.rank)), BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return y
