"""Weight-only int8 and group-wise int4 matmul, dequantizing inside the kernel, over runtime.quant.formats's formats.

The kernels read the snapshot's tensors as they are stored, so nothing is repacked for the GPU:
- int8 (Int8Weight): qweight int8 [N, K], scales [N]; y = (x @ q.T) * scales.
- int4 (Int4Weight): packed uint8 [N, K / 2] in one of runtime.quant.INT4_LAYOUTS (PyTorch's CPU packing:
  blocks of rows, each [K, rows / 2] bytes; "halves" puts rows j and j + rows/2 in a byte, "pairs" rows 2j
  and 2j + 1, low nibble first; a last partial block in pairs), scales_zeros [K / group_size, N, 2];
  w = (u - 8) * scale + zero.
A program computes a [BLOCK_M, BLOCK_N] tile of y over K in steps that never cross an int4 group; the
weight tile is dequantized in float32 and multiplied in x's dtype with float32 accumulation.
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
from warmstart.runtime.quant.formats import INT4_LAYOUTS, Int4Weight, Int8Weight


def quantized_linear_reference(x: torch.Tensor, w: Int8Weight | Int4Weight) -> torch.Tensor:
    """The kernels' arithmetic in float32: int8 codes times x, then the scales; int4 weights dequantized to
    x's dtype (what the kernel multiplies by), times x."""
    if isinstance(w, Int8Weight):
        y = x.float() @ w.qweight.float().t().to(x.device) * w.scales.float().to(x.device)
    else:
        y = x.float() @ w.dequantize(x.dtype).float().t().to(x.device)
    return y.to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _int4_codes(packed_ptr, n, k, N, K, LAYOUT_ROWS: tl.constexpr, HALVES: tl.constexpr):  # type: ignore[no-untyped-def]
        """The 4-bit codes of W[n, k] for n: [1, BLOCK_N] and k: [BLOCK_K, 1], from runtime.quant.formats's packing."""
        full = N // LAYOUT_ROWS * LAYOUT_ROWS
        in_block = n % LAYOUT_ROWS
        if HALVES:
            byte = in_block % (LAYOUT_ROWS // 2)
            shift = in_block // (LAYOUT_ROWS // 2) * 4
        else:
            byte = in_block // 2
            shift = in_block % 2 * 4
        offset = (n // LAYOUT_ROWS * LAYOUT_ROWS) * (K // 2) + k * (LAYOUT_ROWS // 2) + byte
        tail = n >= full  # the last, partial block: pairs of its (N - full) rows
        offset = tl.where(tail, full * (K // 2) + k * ((N - full) // 2) + (n - full) // 2, offset)
        shift = tl.where(tail, (n - full) % 2 * 4, shift)
        codes = tl.load(packed_ptr + offset, mask=(n < N) & (k < K), other=0)
        return (codes.to(tl.int32) >> shift) & 15

    @triton.jit
    def quantized_matmul_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, scales_ptr, out_ptr, M, N, K, group_size,
        IS_INT4: tl.constexpr, LAYOUT_ROWS: tl.constexpr, HALVES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + k[None, :],
                        mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0)  # fmt: skip
            if IS_INT4:
                u = _int4_codes(w_ptr, cols[None, :], k[:, None], N, K, LAYOUT_ROWS, HALVES)
                sz = scales_ptr + ((k0 // group_size) * N + cols) * 2  # BLOCK_K divides group_size
                scale = tl.load(sz, mask=cols < N, other=0.0).to(tl.float32)
                zero = tl.load(sz + 1, mask=cols < N, other=0.0).to(tl.float32)
                w = ((u - 8).to(tl.float32) * scale[None, :] + zero[None, :]).to(x.dtype)
            else:
                w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + k[:, None],
                            mask=(cols < N)[None, :] & (k < K)[:, None], other=0)  # fmt: skip
                w = w.to(tl.float32).to(x.dtype)  # via float32: the interpreter turns int8 into bfloat16 wrongly
            acc += dot(x, w)
        if not IS_INT4:
            acc *= tl.load(scales_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])  # fmt: skip


def quantized_linear(x: torch.Tensor, w: Int8Weight | Int4Weight) -> torch.Tensor:
    """x: [M, K] in a float dtype -> x @ W.T: [M, N] in x's dtype."""
    require_triton(HAVE_TRITON)
    n, k = w.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"input {tuple(x.shape)} does not fit a {w.scheme} weight of shape {w.shape}")
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # Per-shape tiles: decode's few rows in one 16-row tile (tl.dot's minimum), prefill's in tiles of 64.
    block_m = min(max(16, triton.next_power_of_2(m)), 64)
    if isinstance(w, Int4Weight):
        layout_rows, kind = INT4_LAYOUTS[w.layout]
        block_k = min(64, w.group_size)
        args = (w.packed, w.scales_zeros, w.group_size, True, layout_rows, kind == "halves")
    else:
        block_k = 64
        args = (w.qweight, w.scales, 1, False, 1, False)
    packed, scales, group_size, is_int4, layout_rows, halves = args
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    quantized_matmul_kernel[grid](
        x, packed, scales, out, m, n, k, group_size,
        IS_INT4=is_int4, LAYOUT_ROWS=layout_rows, HALVES=halves, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
    )  # fmt: skip
    return out
