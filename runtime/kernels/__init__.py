"""Kernels that replace runtime/layers' PyTorch ops, each tested against the op it replaces: the Triton
kernels of the CUDA path, and the CPU path's C decode-attention kernel (cpu_attention.c, built by setup.py
as ``_cpu_attention``).

``import runtime`` imports only the C kernel from here; the Triton modules import triton (when installed)
only when they are themselves imported, so the CPU path starts fast and works where triton is absent. Triton decides at
decoration time, i.e. when a kernel module is imported, whether its kernels run compiled or under the
interpreter: set ``TRITON_INTERPRET=1`` before importing one to run its kernels on CPU tensors.
"""

from __future__ import annotations

import os
from pathlib import Path


def require_triton(have_triton: bool) -> None:
    if not have_triton:
        raise RuntimeError("the Triton kernels need triton (pip install triton); the PyTorch path does not")


def carried_cache_dir() -> Path:
    """Where Triton keeps compiled kernels: TRITON_CACHE_DIR, or warmstart's own directory next to its
    snapshot cache ($XDG_CACHE_HOME or ~/.cache)/warmstart/triton, which an image or volume that carries the
    snapshot cache carries too, so a cold start loads kernels instead of compiling them."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "warmstart" / "triton"


def use_carried_cache() -> Path:
    """Point Triton at carried_cache_dir() (read by Triton when it compiles, so any time before the first call)."""
    path = carried_cache_dir()
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path
