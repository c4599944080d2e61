"""The few-row bf16 linear kernel (runtime/kernels/cpu_gemv.c) against F.linear in float32 arithmetic on the same
bf16 inputs, on each of its paths up to the instruction set in use (AVX2 with FMA, AVX512-BF16; isa.lowered runs the
AVX2 one on an AVX512-BF16 machine), its dispatch in the CPU ops (runtime/layers/ops.py) and the fallback where it
does not serve (below AVX2, or switched off)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.reference import assert_close_in_bf16
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.kernels import cpu_gemv, isa
from warmstart.runtime.layers.linear import packing_dtype
from warmstart.runtime.layers.ops import TorchOps, select_ops
from warmstart.runtime.quant.formats import Int8Weight
from warmstart.runtime.quant.packed_linear import PackedWeight

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None
pytestmark = pytest.mark.skipif(NO_COMPILER and cpu_gemv._ext is None, reason="no C compiler here")
# the levels up to the one in use (WARMSTART_CPU_ISA=avx2 stops at avx2, as an AVX2 machine would) at which the
# kernel runs: avx2 and above
KERNEL_LEVELS = [level for level in isa.LEVELS[: isa.LEVELS.index(isa.chosen()) + 1]
                 if isa.LEVELS.index(level) >= isa.LEVELS.index("avx2")]  # fmt: skip
CPU = torch.device("cpu")


@pytest.fixture(params=KERNEL_LEVELS)
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel runs at each of its levels for the test."""
    with isa.lowered(request.param):
        assert cpu_gemv.cpu_supported()
        yield request.param


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def assert_one_rounding(ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """ours is the float32 product of the bf16 inputs rounded once to bf16: within half a bf16 unit (at most 2^-8
    relative) of F.linear in float32, plus what summing in another order can move a float32 sum."""
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    order = 1e-6 * (F.linear(x.float().abs(), w.float().abs()) + (0 if b is None else b.float().abs()))
    assert ours.dtype == torch.bfloat16 and ours.shape == exact.shape
    error = (ours.float() - exact).abs()
    limit = exact.abs() * 2.0**-8 + order + 1e-30
    assert bool((error <= limit).all()), f"worst excess {(error - limit).max().item()}"


def test_the_kernel_was_built() -> None:
    assert cpu_gemv._ext is not None, "the gemv kernel is missing: reinstall (pip install -e .)"


@pytest.mark.parametrize("k", [1, 2, 15, 16, 17, 31, 32, 33, 64, 95, 576, 1000])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 13, 832])
def test_every_shape_matches_float32_linear(n: int, k: int, level: str) -> None:
    w = bf16(n, k, seed=n * 1000 + k)
    for rows in range(1, cpu_gemv.KERNEL_MAX_ROWS + 1):
        x = bf16(rows, k, seed=rows)
        assert_one_rounding(cpu_gemv.gemv(x, w), x, w, None)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", range(1, 9))
def test_bias_and_threads(rows: int, threads: int, level: str) -> None:
    """Big enough (3072 x 576) that the rows are split over the threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, b, x = bf16(3072, 576, seed=1), bf16(3072, seed=2), bf16(rows, 576, seed=3)
        assert_one_rounding(cpu_gemv.gemv(x, w, b), x, w, b)
    finally:
        torch.set_num_threads(before)


def test_strided_and_batched_inputs(level: str) -> None:
    w = bf16(40, 70, seed=4)
    wide = bf16(3, 100, seed=5)
    rows_of_a_wider_tensor = wide[:, 10:80]  # row stride 100, not 70: read in place
    assert_one_rounding(cpu_gemv.gemv(rows_of_a_wider_tensor, w), rows_of_a_wider_tensor, w, None)
    transposed = bf16(70, 2, seed=6).t()  # last-dim stride 2: copied first
    assert_one_rounding(cpu_gemv.gemv(transposed, w), transposed, w, None)
    batched = bf16(2, 1, 70, seed=7)
    out = cpu_gemv.gemv(batched, w)
    assert out.shape == (2, 1, 40)
    assert_one_rounding(out.view(2, 40), batched.view(2, 70), w, None)


@pytest.mark.parametrize("lower", KERNEL_LEVELS[:-1] or KERNEL_LEVELS[-1:])
def test_every_path_gives_the_same_products_and_roundings(lower: str) -> None:
    """The paths differ only in the order of their float32 sums (the products of bf16 values are exact): against the
    path of the level in use, at most one bf16 unit apart, and on few outputs. SmolLM2-135M's qkv shape, with bias.
    Where the kernel has one level here (AVX2 machines), that path is held to one rounding of the float32 product."""
    w, b = bf16(960, 576, seed=17), bf16(960, seed=18)
    x = bf16(cpu_gemv.KERNEL_MAX_ROWS, 576, seed=19)
    top = cpu_gemv.gemv(x, w, b)
    if lower == isa.chosen():
        assert_one_rounding(top, x, w, b)
        return
    top = top.float()
    with isa.lowered(lower):
        ours = cpu_gemv.gemv(x, w, b).float()
    unit = top.abs().clamp(min=2.0**-20) * 2.0**-7
    assert bool(((ours - top).abs() <= unit).all())
    assert (ours != top).float().mean() < 0.005  # measured: 1 output in 7,680


def test_what_the_kernel_refuses() -> None:
    w = bf16(8, 16, seed=8)
    assert cpu_gemv.takes(bf16(1, 16, seed=9), w, None)
    assert not cpu_gemv.takes(bf16(1, 16, seed=9).float(), w, None)  # float32 keeps F.linear
    assert not cpu_gemv.takes(bf16(cpu_gemv.KERNEL_MAX_ROWS + 1, 16, seed=9), w, None)
    assert not cpu_gemv.takes(bf16(0, 16, seed=9), w, None)
    assert not cpu_gemv.takes(bf16(1, 15, seed=9), w, None)
    assert not cpu_gemv.takes(bf16(1, 16, seed=9), bf16(16, 8, seed=8).t(), None)  # a non-contiguous weight
    assert not cpu_gemv.takes(bf16(1, 16, seed=9), w, bf16(7, seed=1))
    assert cpu_gemv.fits(bf16(cpu_gemv.MAX_ROWS, 16, seed=9), w, None)
    assert not cpu_gemv.fits(bf16(cpu_gemv.MAX_ROWS + 1, 16, seed=9), w, None)


def test_ops_use_the_kernel_for_few_rows_of_a_plain_or_prepacked_weight(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    kernel = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda x, w, b=None: calls.append(x.shape[0]) or kernel(x, w, b))
    ops = select_ops(CPU, torch.bfloat16)
    assert isinstance(ops, TorchOps) and ops.gemv_kernel
    w, b = bf16(64, 96, seed=10), bf16(64, seed=11)
    packed = PackedWeight(w, packing_dtype(torch.bfloat16))
    for weight in (w, packed):
        x = bf16(2, 96, seed=12)
        assert_one_rounding(ops.linear(x, weight, b), x, w, b)
        many = bf16(cpu_gemv.MAX_ROWS + 1, 96, seed=13)  # more rows: oneDNN / F.linear, bit for bit
        reference = packed.linear(many, b) if weight is packed else F.linear(many, w, b)
        assert torch.equal(ops.linear(many, weight, b), reference)
    assert calls == [2, 2]
    int8 = Int8Weight.quantize(w)  # quantized weights keep their own kernels
    x = bf16(1, 96, seed=14)
    assert torch.equal(ops.linear(x, int8), int8.linear(x))
    assert calls == [2, 2]


def test_fallback_where_the_kernel_does_not_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below AVX2 (an ARM machine, or WARMSTART_CPU_ISA=portable) the ops take the PyTorch path, and the kernel
    itself refuses clearly; float32, and WARMSTART_CPU_GEMV=torch, keep it too."""
    assert not select_ops(CPU, torch.float32).gemv_kernel  # type: ignore[attr-defined]
    w, x = bf16(64, 96, seed=15), bf16(1, 96, seed=16)
    packed = PackedWeight(w, packing_dtype(torch.bfloat16))
    with isa.lowered("portable"):
        assert not cpu_gemv.cpu_supported()
        ops = select_ops(CPU, torch.bfloat16)
        assert not ops.gemv_kernel  # type: ignore[attr-defined]
        assert torch.equal(ops.linear(x, packed), packed.linear(x))
        assert torch.equal(ops.linear(x, w), F.linear(x, w))
        if cpu_gemv._ext is not None:
            with pytest.raises(RuntimeError, match="gemv: the kernel needs AVX2 .* run at 'portable'"):
                cpu_gemv.gemv(x, w)
    assert cpu_gemv.cpu_supported() == (cpu_gemv._ext is not None and isa.at_least("avx2"))
    monkeypatch.setenv(cpu_gemv.GEMV_ENV, "torch")
    assert not select_ops(CPU, torch.bfloat16).gemv_kernel  # type: ignore[attr-defined]
    monkeypatch.setenv(cpu_gemv.GEMV_ENV, "fast")
    with pytest.raises(ValueError, match="WARMSTART_CPU_GEMV='fast' is not one of kernel, torch"):
        select_ops(CPU, torch.bfloat16)


def test_engine_decodes_on_the_kernel_close_to_the_reference(level: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """bf16 sums in another order than oneDNN's can part two greedy runs late; the first tokens agree and the
    chosen tokens' logprobs stay within 0.05 of the reference's while the runs agree."""
    model_dir: Path = tiny_model_dir("llama")
    prompts = [[3, 17, 42, 99, 5, 8, 13, 21, 34] * 4, [7, 1, 2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM.from_hf(model_dir, dtype="bfloat16")
    ops = llm.engine.runner.model.ops
    assert isinstance(ops, TorchOps) and ops.gemv_kernel
    ours = llm.generate(prompts, params)
    ops.gemv_kernel = False
    reference = llm.generate(prompts, params)
    assert_close_in_bf16(ours, reference)
