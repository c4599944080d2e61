"""bfloat16 linear layers for few rows on the CPU (runtime/kernels/cpu_gemv.c): a decode step's matmuls at the speed
of reading the weights once, from the plain row-major weight. The kernel runs AVX512-BF16's dot products where the
kernels' instruction set (runtime/kernels/isa.py) has them, AVX2 with FMA otherwise: the same products, float32 sums.

oneDNN's matmul (on the prepacked copy, runtime/quant/packed_linear.py) stays the path for more rows, for float32
(whose arithmetic the transformers comparison pins down), below AVX2 (``isa.chosen()`` portable: other
architectures, or ``WARMSTART_CPU_ISA=portable``), for installs built without a C compiler, and under
``WARMSTART_CPU_GEMV=torch``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from warmstart.runtime.kernels import isa
from warmstart.runtime.kernels.switches import kernel_chosen

_ext: ModuleType | None
try:  # built by setup.py; absent where the install had no C compiler
    from warmstart.runtime.kernels import _cpu_gemv as _ext
except ImportError:  # pragma: no cover - depends on the install
    _ext = None

GEMV_ENV = "WARMSTART_CPU_GEMV"
KERNEL_MAX_ROWS = _ext.MAX_ROWS if _ext is not None else 0  # the most rows of x the kernel takes per call
# The most rows the CPU ops send it (``fits``); beyond, oneDNN's blocked matmul on the prepacked weight, which reuses
# each weight from cache. `benchmarks/decode.py --kernel-rows` over SmolLM2-135M's linears (quiet, each weight row
# streamed once for up to 4 rows of x): oneDNN / gemv 1.51x at 1 row, 1.47x at 2, 1.31x at 3, 1.11-1.13x at 4-5,
# 1.08x at 6, 1.03x at 7, 0.88x at 8.
MAX_ROWS = 6


def cpu_supported() -> bool:
    """Whether this install has the kernel and the kernels' instruction set (``isa.chosen()``) is one it runs on:
    AVX2 or above."""
    return _ext is not None and isa.at_least("avx2")


def gemv_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel serves a model on ``device`` in ``dtype`` (``WARMSTART_CPU_GEMV=torch`` turns it off);
    ``fits`` then says it per call."""
    return kernel_chosen(GEMV_ENV) and device.type == "cpu" and dtype == torch.bfloat16 and cpu_supported()


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the CPU ops send this product to the kernel: it ``takes`` it and x has at most MAX_ROWS rows."""
    return takes(x, weight, bias) and _rows(x) <= MAX_ROWS


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``gemv(x, weight, bias)`` takes these tensors: bf16, 1 to KERNEL_MAX_ROWS rows of x, a contiguous
    [N, K] weight, a bias of N."""
    return (
        1 <= _rows(x) <= KERNEL_MAX_ROWS
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and x.device.type == weight.device.type == "cpu"
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous() and bias.shape == weight.shape[:1]))
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] of at most KERNEL_MAX_ROWS rows (see ``takes``): float32 sums, one
    rounding to bf16."""
    assert _ext is not None and takes(x, weight, bias)
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    _ext.gemv(
        out.data_ptr(), rows.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
        rows.shape[0], n, k, rows.stride(0) if rows.shape[0] > 1 else k, torch.get_num_threads(),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


# A layer's row of the table ``decode_layers`` takes (cpu_gemv.c's L_* order): pointers, and the layer's row of
# key_starts. qkv_bias 0: none.
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down", "k_cache", "v_cache",
                "window")  # fmt: skip


def decode_layers(
    x: torch.Tensor, layer_table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, tables: torch.Tensor, key_starts: torch.Tensor, key_ends: torch.Tensor, heads: int,
    kv_heads: int, head_dim: int, inter: int, block_size: int, head_stride: int, eps: float,
    final_norm: torch.Tensor | None = None, head: torch.Tensor | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """A decode step's rows x [M, hidden] through every layer of ``layer_table`` [layers, LAYER_FIELDS], in place:
    rms_norm, qkv, rotary, k and v written to their ``slots`` of the pool, attention over it (row m's keys
    key_starts[window, m] <= j < key_ends[m] of its row of ``tables``), o_proj and the residual add, rms_norm,
    gate_up, SiLU-and-mul, down and the residual add. positions, slots, tables and key ranges: int64. With
    ``final_norm`` and ``head`` [vocab, hidden] (bf16, contiguous), also the final rms_norm and the head in the same
    call: returns float32 logits [M, vocab], each rounded to bf16 first as the separate ops round them."""
    assert _ext is not None and x.is_contiguous() and x.dtype == torch.bfloat16
    for t in (layer_table, positions, slots, tables, key_starts, key_ends):
        assert t.dtype == torch.int64 and t.is_contiguous()
    rows, hidden = x.shape
    logits = None
    if head is not None:
        assert final_norm is not None and head.is_contiguous() and head.dtype == torch.bfloat16
        assert head.shape[1] == hidden and final_norm.is_contiguous() and final_norm.dtype == torch.bfloat16
        logits = torch.empty(rows, head.shape[0], dtype=torch.float32)
    _ext.decode_layers(
        x.data_ptr(), layer_table.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
        tables.data_ptr(), key_starts.data_ptr(), key_ends.data_ptr(), rows, layer_table.shape[0], hidden, heads,
        kv_heads, head_dim, inter, block_size, tables.shape[1], head_stride, eps, torch.get_num_threads(),
        0 if final_norm is None else final_norm.data_ptr(), 0 if head is None else head.data_ptr(),
        0 if head is None else head.shape[0], 0 if logits is None else logits.data_ptr(),
    )  # fmt: skip
    return logits
