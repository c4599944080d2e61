"""Weight-only int8 and group-wise int4 matmul kernels against the weights runtime.quant.formats stores, dequantized."""

from __future__ import annotations

import pytest
import torch

from tests.support.kernels_common import DEVICE, assert_close, randn  # sets TRITON_INTERPRET first

pytestmark = pytest.mark.kernels

from warmstart.runtime.kernels.quant_matmul import quantized_linear, quantized_linear_reference  # noqa: E402
from warmstart.runtime.quant.formats import INT4_LAYOUTS, Int4Weight, Int8Weight, _int4_codes_t, int4_layout  # noqa: E402


def tolerance(dtype: torch.dtype, in_features: int) -> tuple[float, float]:
    """The interpreter truncates each dequantized weight to bfloat16 where the reference rounds it; over K
    products the differences add up like a random walk: bfloat16 ulps times sqrt(K), next to outputs whose
    spread is sqrt(K) (unit weights and inputs)."""
    return (1e-4, 1e-4) if dtype == torch.float32 else (2.0**-6 * in_features**0.5, 3e-2)


def pack_int4(codes: torch.Tensor, layout: str) -> torch.Tensor:
    """codes uint8 [N, K] -> packed [N, K / 2] in ``layout`` (the inverse of runtime.quant._int4_codes_t)."""
    n, k = codes.shape
    block, kind = INT4_LAYOUTS[layout]
    full = n // block * block
    parts = []
    for b0 in range(0, full, block):
        rows = codes[b0 : b0 + block].t()  # [K, block]
        lo, hi = (rows[:, : block // 2], rows[:, block // 2 :]) if kind == "halves" else (rows[:, 0::2], rows[:, 1::2])
        parts.append((lo | hi << 4).reshape(-1))
    if full < n:
        rows = codes[full:].t()
        parts.append((rows[:, 0::2] | rows[:, 1::2] << 4).reshape(-1))
    return torch.cat(parts).view(n, k // 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 96, 64), (7, 80, 80), (37, 200, 192)])
def test_int8_matmul_matches_reference(rows: int, out_features: int, in_features: int, dtype: torch.dtype) -> None:
    w = Int8Weight.quantize(randn(out_features, in_features, dtype=dtype, seed=rows).cpu())
    x = randn(rows, in_features, dtype=dtype, seed=out_features)
    on_device = Int8Weight(w.qweight.to(DEVICE), w.scales.to(DEVICE))
    assert_close(quantized_linear(x, on_device), quantized_linear_reference(x, w), tolerance(dtype, in_features))


needs_int4 = pytest.mark.skipif(int4_layout() is None, reason="runtime.quant packs int4 with PyTorch's CPU kernel")


@needs_int4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("group_size", "rows", "out_features", "in_features"),
    [(32, 1, 96, 64), (32, 5, 208, 96), (128, 3, 80, 256), (128, 33, 144, 128)],  # full and partial row blocks
)
def test_int4_matmul_matches_reference(
    group_size: int, rows: int, out_features: int, in_features: int, dtype: torch.dtype
) -> None:
    w = Int4Weight.quantize(randn(out_features, in_features, dtype=dtype, seed=rows).cpu(), group_size)
    x = randn(rows, in_features, dtype=dtype, seed=group_size)
    on_device = Int4Weight(w.packed.to(DEVICE), w.scales_zeros.to(DEVICE), group_size, w.layout)
    assert_close(quantized_linear(x, on_device), quantized_linear_reference(x, w), tolerance(dtype, in_features))


@needs_int4
@pytest.mark.parametrize("layout", sorted(INT4_LAYOUTS))
def test_int4_matmul_reads_every_stored_layout(layout: str) -> None:
    """A snapshot built on another kind of CPU stores another packing; the kernel reads it as it is."""
    n, k, group_size = 112, 64, 32  # one full block of 64 or three of 32, then a partial one
    local = Int4Weight.quantize(randn(n, k, dtype=torch.float32, seed=1).cpu(), group_size)
    codes = _int4_codes_t(local.packed, n, k, local.layout).t()
    stored = Int4Weight(pack_int4(codes, layout).to(DEVICE), local.scales_zeros.to(DEVICE), group_size, layout)
    x = randn(3, k, dtype=torch.float32, seed=2)
    assert_close(quantized_linear(x, stored), quantized_linear_reference(x, local), tolerance(torch.float32, k))


def test_rejects_an_input_of_the_wrong_width() -> None:
    w = Int8Weight.quantize(torch.randn(32, 64))
    with pytest.raises(ValueError, match="does not fit"):
        quantized_linear(torch.zeros(2, 48, device=DEVICE), w)
