"""SiLU-and-mul for the MLP: [N, 2I] (gate then up, as ``chunk(2, dim=-1)`` splits it) -> silu(gate) * up."""

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
    def silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
        g32 = gate.to(tl.float32)
        silu = (g32 * tl.sigmoid(g32)).to(gate.dtype)  # torch rounds silu to the dtype before the product
        tl.store(out_ptr + row * inter + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    require_triton(HAVE_TRITON)
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension of {tuple(x.shape)} must be even: gate and up halves side by side")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter).contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(inter)
    silu_and_mul_kernel[(x2.shape[0],)](x2, out, inter, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return out.view(*x.shape[:-1], inter)
