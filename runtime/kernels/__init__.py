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
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def require_triton(have_triton: bool) -> None:
    if not have_triton:
        raise RuntimeError("the Triton kernels need triton (pip install triton); the PyTorch path does not")


_carried_base: Path | None = None


def carry_kernels_under(base: Path) -> None:
    """Keep compiled kernels under ``base`` (the loader passes its snapshot cache, which a volume or an image
    carries), unless TRITON_CACHE_DIR says otherwise; takes effect at the next model built on the Triton path."""
    global _carried_base
    _carried_base = base


def cache_key(device: torch.device | None = None) -> str:
    """What a compiled kernel is valid for: the GPU architecture and the torch and triton versions, e.g.
    ``sm90-torch2.5.1+cu124-triton3.1.0`` (a kernel carried to another GPU or another Triton is not used)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    key = f"{architecture(device)}-torch{torch.__version__}-triton{triton_version}"
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", key)


def architecture(device: torch.device | None = None) -> str:
    """``sm<major><minor>`` of a CUDA device (the current one when ``device`` is None and CUDA is there), the
    gfx name of a ROCm one, else the device type."""
    import torch

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return device.type
    if torch.version.hip:
        return str(torch.cuda.get_device_properties(device).gcnArchName).split(":")[0]
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def carried_cache_dir(device: torch.device | None = None) -> Path:
    """Where Triton keeps compiled kernels: TRITON_CACHE_DIR when set (an image's own choice, used as it is),
    else a directory named by cache_key() under carry_kernels_under()'s base, by default warmstart's own
    directory ($XDG_CACHE_HOME or ~/.cache)/warmstart/triton. What an image or volume carries there is
    loaded at a cold start instead of compiled, on the same GPU architecture and versions only."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return (_carried_base or default_cache_base()) / cache_key(device)


def default_cache_base() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "warmstart" / "triton"


def use_carried_cache(device: torch.device | None = None) -> Path:
    """Point Triton at carried_cache_dir() (read by Triton when it compiles, so any time before the first call).
    Triton reads one directory per process: the first choice stands."""
    path = carried_cache_dir(device)
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path


def cached_kernels(path: Path) -> int:
    """How many compiled kernels (Triton's one directory per cache key) ``path`` holds."""
    try:
        return sum(1 for e in os.scandir(path) if e.is_dir())
    except FileNotFoundError:
        return 0
