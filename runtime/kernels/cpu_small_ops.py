"""The CPU path's fused small ops (runtime/kernels/cpu_small_ops.c): RMSNorm with the residual add, rotary in
place, SiLU-and-mul. Each mirrors its PyTorch reference in runtime/layers/ (norm, rotary, activation), which stays
the path for other devices and dtypes, for installs built without a C compiler, and under
``WARMSTART_CPU_SMALL_OPS=torch``. The kernels run the copy compiled for the instruction set runtime/kernels/isa.py
chose (AVX-512, AVX2, or portable C on other CPUs), with the same results but where bf16 SiLU's exp is vectorised.
"""

from __future__ import annotations

from types import ModuleType

import torch

from warmstart.runtime.kernels.switches import kernel_chosen

_ext: ModuleType | None
try:  # built by setup.py; absent where the install had no C compiler
    from warmstart.runtime.kernels import _cpu_small_ops as _ext
except ImportError:  # pragma: no cover - depends on the install
    _ext = None

SMALL_OPS_ENV = "WARMSTART_CPU_SMALL_OPS"


def small_ops_kernel_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernels serve a model on ``device`` in ``dtype`` (``WARMSTART_CPU_SMALL_OPS=torch`` turns
    them off); ``fits`` then says it per call."""
    return (
        kernel_chosen(SMALL_OPS_ENV)
        and _ext is not None
        and device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
    )


def fits(x: torch.Tensor, width: int) -> bool:
    """Whether the kernels take rows of ``width`` elements of x's dtype (wider ones take the PyTorch path)."""
    return _ext is not None and x.dtype in (torch.float32, torch.bfloat16) and width <= _ext.MAX_DIM


def _bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dim of x [..., dim], whose rows may be strided (a view of heads) but each contiguous."""
    assert _ext is not None and x.dtype == weight.dtype and weight.is_contiguous()
    dim = x.shape[-1]
    rows = x.reshape(-1, dim) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    _ext.rms_norm(out.data_ptr(), 0, rows.data_ptr(), 0, weight.data_ptr(), rows.shape[0], rows.stride(0), dim,
                  eps, _bf16(x), torch.get_num_threads())
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [N, dim], in one pass."""
    assert _ext is not None and x.dtype == residual.dtype == weight.dtype
    x, residual = x.contiguous(), residual.contiguous()
    out, summed = torch.empty_like(x), torch.empty_like(x)
    _ext.rms_norm(out.data_ptr(), summed.data_ptr(), x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                  x.shape[0], x.shape[1], x.shape[1], eps, _bf16(x), torch.get_num_threads())
    return out, summed


def rotary_args(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return cos.contiguous(), sin.contiguous(), positions.to(torch.int64).contiguous()


def rotary(
    q: torch.Tensor, k: torch.Tensor, args: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [N, heads, D] and k [N, kv_heads, D] in place (views of one step's fresh qkv output, whose
    rows may be strided but whose heads are contiguous) and returns them."""
    assert _ext is not None
    cos, sin, positions = args
    for t in (q, k):
        assert t.dtype == cos.dtype and t.stride(2) == 1 and t.stride(1) == t.shape[2]
    n, heads, head_dim = q.shape
    _ext.rotary(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), n, q.stride(0),
                k.stride(0), heads, k.shape[1], head_dim, _bf16(q), torch.get_num_threads())
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2F] = [gate | up] -> silu(gate) * up [N, F]."""
    assert _ext is not None
    x = x.contiguous()
    width = x.shape[-1] // 2
    out = x.new_empty(x.shape[0], width)
    _ext.silu_and_mul(out.data_ptr(), x.data_ptr(), x.shape[0], width, _bf16(x), torch.get_num_threads())
    return out
