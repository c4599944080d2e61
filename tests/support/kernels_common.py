"""What every kernel test shares. Importing this sets TRITON_INTERPRET=1 when there is no GPU.

Triton picks interpreter or compiler when a function is decorated, so the variable must be set before triton
is first imported (triton.language decorates its own helpers then). tests/conftest.py sets it before any
test module loads (other tests import triton too: peft does); this module repeats it for whatever imports
it outside pytest.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = not torch.cuda.is_available()
# (atol, rtol). The interpreter casts float32 to bfloat16 by truncation where the GPU and torch round to
# nearest, so each rounding inside a kernel may land one bfloat16 ulp (2^-7 relative at worst) below torch's;
# silu-and-mul and rms_norm round twice.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: tuple[float, float] | None = None) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    atol, rtol = tolerance or TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
