"""Triton kernels for the CUDA path, each beside its PyTorch reference.

``import runtime`` never imports this package; its modules import triton (when installed) only when they
are themselves imported, so the CPU path starts fast and works where triton is absent. Triton decides at
decoration time, i.e. when a kernel module is imported, whether its kernels run compiled or under the
interpreter: set ``TRITON_INTERPRET=1`` before importing one to run its kernels on CPU tensors.
"""

from __future__ import annotations


def require_triton(have_triton: bool) -> None:
    if not have_triton:
        raise RuntimeError("the Triton kernels need triton (pip install triton); the PyTorch path does not")
