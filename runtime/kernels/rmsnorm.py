"""RMSNorm, plain and fused with the residual add, one program per row.

The arithmetic is that of runtime/layers/norm.py, the reference the tests hold these kernels to: the residual
add rounds to the input dtype, the norm runs in float32 (``x * rsqrt(mean(x^2) + eps)``), is cast back to the
input dtype, then multiplied by the weight.
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
    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,  # type: ignore[no-untyped-def]
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        offs = row * hidden + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # one rounding, as torch's add
            tl.store(res_out_ptr + offs, x, mask=mask)
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
        normed = (x32 * rstd).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    require_triton(HAVE_TRITON)
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},) for input {tuple(x.shape)}")
    x2 = x.reshape(-1, hidden).contiguous()
    res2 = residual.reshape(-1, hidden).contiguous() if residual is not None else None
    out = torch.empty_like(x2, dtype=torch.promote_types(x.dtype, weight.dtype))
    res_out = torch.empty_like(x2) if res2 is not None else None
    block = triton.next_power_of_2(hidden)
    # Without a residual the kernel never reads or writes the residual pointers; x2 stands in for them.
    res_in = res2 if res2 is not None else x2
    res_dst = res_out if res_out is not None else x2
    rms_norm_kernel[(x2.shape[0],)](
        x2, res_in, weight.contiguous(), out, res_dst, hidden, eps,
        HAS_RESIDUAL=res2 is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
    )
    return out.view(x.shape), res_out.view(x.shape) if res_out is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm over the last dimension of ``x`` (any leading shape, e.g. [N, heads, head_dim] for QK norm)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over each row; new tensors, inputs untouched."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed
