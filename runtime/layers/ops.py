"""The decoder's operations, chosen once per model: PyTorch ops (the CPU path) or the Triton kernels (the
CUDA path, runtime/kernels/).

``WARMSTART_KERNELS=torch|triton`` chooses; by default a model on a CUDA device gets the kernels and one on
the CPU gets PyTorch. On the CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``,
set before the process starts), which is how the CUDA path's wiring is proven without a GPU.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch

from warmstart.runtime.kernels import cpu_gemv
from warmstart.runtime.kernels import cpu_small_ops as small_ops
from warmstart.runtime.layers import attention
from warmstart.runtime.layers.activation import silu_and_mul
from warmstart.runtime.layers.attention import AttentionMetadata
from warmstart.runtime.layers.linear import LinearWeight, linear, plain_weight
from warmstart.runtime.layers.norm import add_rms_norm, rms_norm
from warmstart.runtime.layers.rotary import RotaryTables, apply_rotary

KERNELS_ENV = "WARMSTART_KERNELS"
CHOICES = ("torch", "triton")


class Ops(Protocol):
    name: str
    @property
    def ragged_decode(self) -> bool:
        """Decode attention costs each sequence only its own length, so the runner need not split decode
        sequences into length groups (runtime/engine/model_runner.py) to save padding."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def rotary_args(self, tables: RotaryTables, positions: torch.Tensor) -> Any:
        """What ``rotary`` needs for a step's positions, computed once per step."""

    def rotary(self, q: torch.Tensor, k: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
        window: int | None, scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor: ...  # fmt: skip

    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor: ...


class TorchOps:
    name = "torch"

    def __init__(self, decode_kernel: bool = False, small_ops_kernel: bool = False, gemv_kernel: bool = False) -> None:
        self.decode_kernel = decode_kernel  # decode attention on runtime/kernels/cpu_attention.c
        self.small_ops_kernel = small_ops_kernel  # norms, rotary, SiLU-and-mul on runtime/kernels/cpu_small_ops.c
        self.gemv_kernel = gemv_kernel  # bf16 linears of few rows on runtime/kernels/cpu_gemv.c

    @property
    def ragged_decode(self) -> bool:
        return self.decode_kernel

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.small_ops_kernel and x.dtype == weight.dtype and small_ops.fits(x, x.shape[-1]):
            return small_ops.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (self.small_ops_kernel and x.dim() == 2 and x.dtype == residual.dtype == weight.dtype
                and small_ops.fits(x, x.shape[-1])):
            return small_ops.add_rms_norm(x, residual, weight, eps)
        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_ops_kernel and x.dim() == 2 and small_ops.fits(x, x.shape[-1] // 2):
            return small_ops.silu_and_mul(x)
        return silu_and_mul(x)

    def rotary_args(self, tables: RotaryTables, positions: torch.Tensor) -> Any:
        if self.small_ops_kernel and small_ops.fits(tables.cos, tables.cos.shape[-1]):
            return small_ops.rotary_args(tables.cos, tables.sin, positions)
        return tables.lookup(positions)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if len(args) == 3:  # rotary_args chose the kernel: (cos table, sin table, positions)
            return small_ops.rotary(q, k, args)
        return apply_rotary(q, k, *args)

    def write_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        attention.write_kv(cache, k, v, slot_mapping)

    def paged_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
        window: int | None, scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return attention.paged_attention(q, k, v, cache, meta, window, self.decode_kernel, scale=scale,
                                         softcap=softcap)

    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.gemv_kernel:
            plain = plain_weight(w)
            if plain is not None and cpu_gemv.fits(x, plain, bias):
                return cpu_gemv.gemv(x, plain, bias)
        return linear(x, w, bias)


def select_ops(
    device: torch.device, dtype: torch.dtype = torch.float32, attention_shape: tuple[int, int] | None = None
) -> Ops:
    """The ops for a model in ``dtype`` on ``device``, from WARMSTART_KERNELS or the device's default.
    ``attention_shape``: the model's (query heads per KV head, head_dim); without it, decode attention on the
    CPU takes the gather path."""
    choice = os.environ.get(KERNELS_ENV) or ("triton" if device.type == "cuda" else "torch")
    if choice not in CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "torch":
        kernel = attention_shape is not None and attention.decode_kernel_serves(device, dtype, *attention_shape)
        return TorchOps(
            decode_kernel=kernel,
            small_ops_kernel=small_ops.small_ops_kernel_serves(device, dtype),
            gemv_kernel=cpu_gemv.gemv_serves(device, dtype),
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{KERNELS_ENV}=triton on the CPU runs the kernels under Triton's interpreter: also set "
            "TRITON_INTERPRET=1 before starting (or use the default PyTorch path)"
        )
    # Imported here, not at the top: the CPU path never pays for importing triton (cold start).
    from warmstart.runtime.kernels import use_carried_cache

    use_carried_cache(device)
    from warmstart.runtime.kernels.ops import TritonOps

    return TritonOps()
