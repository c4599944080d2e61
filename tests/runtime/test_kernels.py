"""Each Triton kernel against its PyTorch reference over odd shapes.

Without a GPU the kernels run on CPU tensors under Triton's interpreter. Triton picks interpreter or
compiler when a function is decorated, so TRITON_INTERPRET=1 must be set before triton is first imported:
tests.support.kernels_common does it, and every kernels test file imports it before any kernel. On a CUDA machine
the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.kernels_common import DEVICE, EPS, INTERPRETED, assert_close, randn  # sets TRITON_INTERPRET first

pytestmark = pytest.mark.kernels

from tests.support.imports import imported_after  # noqa: E402
from warmstart.runtime.kernels.activation import silu_and_mul  # noqa: E402
from warmstart.runtime.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from warmstart.runtime.layers.activation import silu_and_mul as silu_and_mul_reference  # noqa: E402
from warmstart.runtime.layers.norm import add_rms_norm as fused_add_rms_norm_reference  # noqa: E402
from warmstart.runtime.layers.norm import rms_norm as rms_norm_reference  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("hidden", [64, 80, 576, 1000])
def test_rms_norm_matches_reference(hidden: int, rows: int, dtype: torch.dtype) -> None:
    x = randn(rows, hidden, dtype=dtype, seed=hidden + rows) * 3
    weight = randn(hidden, dtype=dtype, seed=1)
    assert_close(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("hidden", [64, 80, 576, 1000])
def test_fused_add_rms_norm_matches_reference(hidden: int, rows: int, dtype: torch.dtype) -> None:
    x = randn(rows, hidden, dtype=dtype, seed=hidden + rows)
    residual = randn(rows, hidden, dtype=dtype, seed=hidden * rows) * 4
    weight = randn(hidden, dtype=dtype, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    out, summed = fused_add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_summed = fused_add_rms_norm_reference(x, residual, weight, EPS)
    # One rounding of the add on both sides: equal when compiled, within one ulp under the interpreter.
    ulp = 2.0**-7 if INTERPRETED and dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(summed, expected_summed, atol=0, rtol=ulp)
    assert_close(out, expected_out)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_over_heads_normalizes_each_head() -> None:
    """QK norm's shape: [N, heads, head_dim] with one weight of head_dim."""
    x = randn(5, 7, 80, dtype=torch.float32, seed=3)
    weight = randn(80, dtype=torch.float32, seed=4)
    assert_close(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("inter", [64, 80, 576, 1000])
def test_silu_and_mul_matches_reference(inter: int, rows: int, dtype: torch.dtype) -> None:
    x = randn(rows, 2 * inter, dtype=dtype, seed=inter + rows) * 3
    assert_close(silu_and_mul(x), silu_and_mul_reference(x))


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


def test_runtime_imports_neither_triton_nor_the_triton_kernels() -> None:
    modules = imported_after("import warmstart.runtime, warmstart.runtime.models.model, "
                             "warmstart.runtime.engine.engine")
    kernels = {m.removeprefix("warmstart.runtime.kernels.") for m in modules
               if m.startswith("warmstart.runtime.kernels.")}
    cpu_kernels = {"_cpu_attention", "_cpu_small_ops", "cpu_small_ops", "_cpu_gemv", "cpu_gemv", "_cpu_lora",
                   "cpu_lora", "isa", "switches"}
    assert "triton" not in modules and kernels <= cpu_kernels


def test_first_call_timings_cover_every_kernel() -> None:
    from benchmarks.kernel_first_calls import first_call_seconds
    from tests.support.model_configs import FAMILIES
    from warmstart.runtime.models.config import ModelConfig

    config = ModelConfig.from_dict(FAMILIES["qwen3"])
    timings = first_call_seconds(config, torch.float32, torch.device(DEVICE))
    assert {"rms_norm", "decode_attention_split", "prefill_attention", "int8_matmul", "rotary"} <= set(timings)
    assert all(t["first_s"] > 0 and t["second_s"] > 0 for t in timings.values())


def test_triton_cache_defaults_next_to_the_snapshot_cache(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import warmstart.runtime.kernels
    from warmstart.runtime.kernels import cache_key, carried_cache_dir, use_carried_cache

    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # restored after the test: the code under test sets it
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(warmstart.runtime.kernels, "_carried_base", None)
    cpu = torch.device("cpu")
    assert use_carried_cache(cpu) == tmp_path / "warmstart" / "triton" / cache_key(cpu)
    assert carried_cache_dir() == tmp_path / "warmstart" / "triton" / cache_key(cpu)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "image"))
    assert carried_cache_dir() == tmp_path / "image"
