"""``tl.dot`` with float32 accumulation that is also right under Triton's interpreter.

The interpreter (triton 3.9) keeps bfloat16 tensors as raw 16-bit integers and multiplies those bits in
``tl.dot``, so there both operands are widened to float32 first. That is the same arithmetic as the GPU's:
a product of two bfloat16 values is exact in float32 and tensor cores accumulate in float32.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

WIDEN_OPERANDS = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def dot(a, b):  # type: ignore[no-untyped-def]
    if WIDEN_OPERANDS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")
