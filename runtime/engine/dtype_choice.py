"""``dtype="auto"``: what a model computes in on this host, and what the CPU path runs on, for logs and metrics.

On the CPU, bfloat16 wherever the kernels have a vector path (AVX2 and up: runtime/kernels/isa.py): decode reads
the bf16 weights once per step, widening them in registers where the CPU has no bf16 dot products, and prefill
multiplies float32 copies widened at load (runtime/quant/packed_linear.py), so no CPU kind pays for emulated bf16
arithmetic. Without AVX2 (other architectures), float32. On CUDA, bfloat16. A snapshot always stores bf16 (its build
resolves "auto" so), which every kind serves.
"""

from __future__ import annotations

from typing import Any

import torch

from warmstart.runtime.engine.options import AUTO
from warmstart.runtime.kernels import isa
from warmstart.runtime.layers.linear import packing_dtype
from warmstart.runtime.models.weights import DTYPES

SNAPSHOT_DTYPE = "bfloat16"  # what `warmstart build --dtype auto` stores: portable to every CPU kind


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``dtype`` itself, or for "auto" the fastest for ``device`` (see the module's comment)."""
    if dtype != AUTO:
        return dtype
    if device.type != "cpu" or isa.at_least("avx2"):
        return "bfloat16"
    return "float32"


def stored_dtype(dtype: str) -> str:
    """What a snapshot built with ``--dtype dtype`` stores."""
    return SNAPSHOT_DTYPE if dtype == AUTO else dtype


def cpu_path(dtype: str, device: torch.device) -> dict[str, Any]:
    """What serves a ``dtype`` model on ``device``: the kernels' instruction set and the dtype prefill's matmuls
    compute in (None off the CPU)."""
    if device.type != "cpu":
        return {"cpu_isa": None, "matmul_dtype": None}
    packed = packing_dtype(DTYPES[dtype])
    return {"cpu_isa": isa.chosen(), "matmul_dtype": str(packed or DTYPES[dtype]).removeprefix("torch.")}
