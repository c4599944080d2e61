"""Many LoRA adapters over one bf16 step on the CPU (runtime/kernels/cpu_lora.c): each fused linear's shrink and
expand for every row of the flat batch in one call, added into the base output in place.

The kernel runs AVX512-BF16 dot products, or on CPUs without them AVX2 with FMA and F16C, as runtime/kernels/isa.py
chose. The PyTorch path (runtime/layers/lora.add_lora: a gather, two to four batched matmuls, a cat and an index_add
per linear) stays the reference and the path for float32 models (whose arithmetic the transformers + PEFT comparison
pins down), other devices, CPUs without AVX2 (or kernels lowered to ``portable``), installs built without a C
compiler, and ``WARMSTART_CPU_LORA=torch``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from warmstart.runtime.kernels import isa
from warmstart.runtime.kernels.switches import kernel_chosen
from warmstart.runtime.layers.lora import LoraStep
from warmstart.runtime.layers.lora import add_lora as torch_add_lora

_ext: ModuleType | None
try:  # built by setup.py; absent where the install had no C compiler
    from warmstart.runtime.kernels import _cpu_lora as _ext
except ImportError:  # pragma: no cover - depends on the install
    _ext = None

LORA_ENV = "WARMSTART_CPU_LORA"
MAX_SLICES = _ext.MAX_SLICES if _ext is not None else 0  # fused slices per linear (q, k, v)
MAX_RANK = _ext.MAX_RANK if _ext is not None else 0  # the slots' rank (--max-lora-rank); beyond, the PyTorch path


def cpu_supported() -> bool:
    """Whether this install has the kernel and the instruction set the kernels run at has what it needs (AVX2 with
    FMA and F16C at least; isa.py, which a lowered level honours)."""
    return _ext is not None and isa.at_least("avx2")


def lora_kernel_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel serves LoRA for a model on ``device`` in ``dtype`` (``WARMSTART_CPU_LORA=torch`` turns it
    off); ``add_lora`` then takes every call, falling back to the PyTorch path for tensors it does not take."""
    return kernel_chosen(LORA_ENV) and device.type == "cpu" and dtype == torch.bfloat16 and cpu_supported()


def takes(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel takes these: bf16 CPU tensors, y [n, out] and x [n, in] with contiguous rows, the slot
    stacks contiguous, at most MAX_SLICES slices of at most MAX_RANK."""
    return (
        y.dtype == x.dtype == a.dtype == b.dtype == torch.bfloat16
        and y.device.type == x.device.type == a.device.type == "cpu"
        and y.dim() == x.dim() == 2
        and y.shape[0] == x.shape[0]
        and y.stride(-1) == 1
        and x.stride(-1) == 1
        and (y.shape[0] < 2 or y.stride(0) >= y.shape[1])  # rows apart, not overlapping
        and (x.shape[0] < 2 or x.stride(0) >= x.shape[1])
        and a.is_contiguous()
        and b.is_contiguous()
        and a.shape[2] <= MAX_SLICES
        and a.shape[3] <= MAX_RANK
        and a.shape[1] == x.shape[1]
        and b.shape[2] == y.shape[1]
    )


def add_lora(y: torch.Tensor, x: torch.Tensor, step: LoraStep, layer: int, module: str) -> torch.Tensor:
    """``y`` (the base linear's output for ``x``, [n, out]) plus each row's adapter's B @ A @ x, in place: as
    runtime/layers/lora.add_lora, in one kernel call (float32 sums, one rounding of y + delta; see cpu_lora.c); on
    the PyTorch path where the kernel does not take the tensors or the instruction set in use lacks AVX2."""
    if module not in step.modules:
        return y
    a, b = step.slots.a[layer][module], step.slots.b[layer][module]
    if _ext is None or not cpu_supported() or not takes(y, x, a, b) or not step.module_ranks:
        return torch_add_lora(y, x, step, layer, module)
    outs = step.slots.out_slices[module]
    y_stride, x_stride = max(y.stride(0), y.shape[1]), max(x.stride(0), x.shape[1])  # a single row's is any
    _ext.sgmv(
        y.data_ptr(), y_stride, x.data_ptr(), x_stride, a.data_ptr(), b.data_ptr(), step.rows.data_ptr(),
        step.tile_slots.data_ptr(), step.tile_starts.data_ptr(), step.tile_ends.data_ptr(),
        step.module_ranks[module].data_ptr(), y.shape[0], step.rows.numel(), step.num_tiles, a.shape[0],
        a.shape[1], a.shape[3], (*outs, *[0] * (MAX_SLICES - len(outs))), torch.get_num_threads(),
    )  # fmt: skip
    return y
