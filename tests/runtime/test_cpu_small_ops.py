"""The fused small ops' C kernels (runtime/kernels/cpu_small_ops.c) against their PyTorch references
(runtime/layers/norm.py, rotary.py, activation.py) at every instruction set up to the one in use (isa.lowered: on
an AVX-512 machine the AVX2 and portable copies run too), and the engine on either path."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.kernels import cpu_small_ops as kernels
from warmstart.runtime.kernels import isa
from warmstart.runtime.layers import activation, norm, rotary
from warmstart.runtime.layers.ops import select_ops

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None
pytestmark = pytest.mark.skipif(NO_COMPILER and kernels._ext is None, reason="no C compiler here")
DTYPES = (torch.bfloat16, torch.float32)
# the levels this machine runs (WARMSTART_CPU_ISA=avx2 stops at avx2, as an AVX2 machine would)
LEVELS = isa.LEVELS[: isa.LEVELS.index(isa.chosen()) + 1]
VECTOR_EXP = [level for level in LEVELS if level != "portable"]  # bf16 SiLU's exp8 / exp16 in place of expf


@pytest.fixture(params=LEVELS)
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernels run at each level for the test."""
    with isa.lowered(request.param):
        yield request.param


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def same(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """bfloat16: bit for bit (the kernels round where the reference rounds). float32: within a few ulps, since the
    norm's sum of squares and expf add up in another order."""
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    if ours.dtype == torch.bfloat16:
        assert torch.equal(ours, reference), (ours.float() - reference.float()).abs().max()
    else:
        torch.testing.assert_close(ours, reference, rtol=2e-6, atol=2e-6)


def test_the_kernels_were_built() -> None:
    assert kernels._ext is not None, "the small-ops kernels are missing: reinstall (pip install -e .)"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows cross the size where the kernels use every thread
def test_norms_match_the_reference(dtype: torch.dtype, rows: int, threads: int, level: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=gen).to(dtype) * 3 for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    same(kernels.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5))
    (h, summed), (ref_h, ref_summed) = kernels.add_rms_norm(x, residual, weight, 1e-5), norm.add_rms_norm(
        x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)  # one rounded add: exact in either dtype
    same(h, ref_h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_of_heads_in_a_strided_view(dtype: torch.dtype, level: str) -> None:
    """q_norm / k_norm (Qwen3) normalise each head of a view into the qkv output."""
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16).to(dtype)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    weight = (1 + 0.1 * torch.randn(16)).to(dtype)
    same(kernels.rms_norm(q, weight, 1e-6), norm.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 300])
def test_rotary_in_place_matches_the_reference_exactly(dtype: torch.dtype, tokens: int, threads: int, level: str
                                                        ) -> None:  # fmt: skip
    heads, kv_heads, head_dim = 9, 3, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    tables = rotary.RotaryTables(inv_freq, 1.0, 4096, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    v_before = v.clone()
    ref_q, ref_k = rotary.apply_rotary(q, k, *tables.lookup(positions))
    out_q, out_k = kernels.rotary(q, k, kernels.rotary_args(tables.cos, tables.sin, positions))
    # no transcendental and no reduction: equal in float32 too (built without fused multiply-add)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert out_q.data_ptr() == q.data_ptr() and torch.equal(v, v_before)  # in place, v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, rows: int, threads: int, level: str) -> None:
    x = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    same(kernels.silu_and_mul(x), activation.silu_and_mul(x))


@pytest.mark.parametrize("width", [1536, 23])  # whole vectors, and a tail (masked on AVX-512, padded on AVX2)
def test_silu_and_mul_at_the_edges_of_exp(width: int, level: str) -> None:
    """bfloat16 on AVX2 and AVX-512 computes exp on 8 or 16 lanes (vec256.h, vec512.h) rather than with expf: where
    exp underflows or overflows, at zero, infinities and NaN it still gives the reference's values."""
    edges = [-200.0, -104.5, -90.0, -88.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 88.0, 90.0, 200.0, float("inf"),
             float("-inf"), float("nan"), 3.0e38]  # fmt: skip
    gate = torch.tensor(edges * (width // len(edges) + 1))[:width]
    up = torch.linspace(-3, 3, width)
    x = torch.cat([gate, up])[None].to(torch.bfloat16)
    ours, reference = kernels.silu_and_mul(x), activation.silu_and_mul(x)
    assert torch.equal(ours.isnan(), reference.isnan())
    assert torch.equal(ours[~ours.isnan()], reference[~reference.isnan()])


def test_silu_and_mul_over_many_rows_in_bfloat16(level: str) -> None:
    """The vector exps (and expf) against the reference over three million values: equal but for a rounding
    boundary now and then (none at this seed; a handful would be one bfloat16 unit each)."""
    x = (torch.randn(2048, 2 * 1536, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16)
    ours, reference = kernels.silu_and_mul(x), activation.silu_and_mul(x)
    differ = ours != reference
    assert int(differ.sum()) <= 16
    unit = reference.float().abs()[differ] * 2.0**-7
    assert ((ours.float() - reference.float()).abs()[differ] <= unit).all()


def test_the_vector_exps_give_the_same_bits() -> None:
    """exp8 (AVX2) computes exp16's (AVX-512) polynomial and scaling: bf16 SiLU-and-mul agrees to the bit between
    the two over three million values, at the edges of exp too."""
    edges = torch.tensor([-200.0, -104.5, -100.0, -90.0, -88.0, 88.72, 88.8, 90.0, float("inf"), float("-inf")])
    x = (torch.randn(2048, 2 * 1536, generator=torch.Generator().manual_seed(6)) * 4).to(torch.bfloat16)
    x[0, : edges.numel()] = edges.to(torch.bfloat16)
    outs = []
    for level in VECTOR_EXP:
        with isa.lowered(level):
            outs.append(kernels.silu_and_mul(x).view(torch.int16))  # bits: silu(-inf) is NaN
    assert all(torch.equal(out, outs[0]) for out in outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_rotations_do_not_depend_on_the_level(dtype: torch.dtype) -> None:
    """The norm's sum of squares adds in 16 fixed lanes and rotary has no reduction: every level's copy gives the
    same bits, float32 included."""
    gen = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(64, 1000, generator=gen).to(dtype) * 3 for _ in range(2))  # 1000: a 16-lane tail
    weight = (1 + 0.1 * torch.randn(1000, generator=gen)).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    tables = rotary.RotaryTables(inv_freq, 1.0, 4096, dtype)
    positions = torch.randint(0, 4096, (64,), generator=gen)
    qkv = torch.randn(64, 12 * 64, generator=gen).to(dtype)
    outs = []
    for level in LEVELS:
        with isa.lowered(level):
            q, k = qkv.clone()[:, : 9 * 64].view(64, 9, 64), qkv.clone()[:, 9 * 64 :].view(64, 3, 64)
            q, k = kernels.rotary(q, k, kernels.rotary_args(tables.cos, tables.sin, positions))
            outs.append((kernels.rms_norm(x, weight, 1e-5), *kernels.add_rms_norm(x, residual, weight, 1e-5), q, k))
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0], strict=True))


def test_cpu_models_get_the_kernels_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert select_ops(cpu, torch.bfloat16).small_ops_kernel  # type: ignore[attr-defined]
    assert not select_ops(cpu, torch.float16).small_ops_kernel  # type: ignore[attr-defined]
    monkeypatch.setenv(kernels.SMALL_OPS_ENV, "torch")
    assert not select_ops(cpu, torch.bfloat16).small_ops_kernel  # type: ignore[attr-defined]
    monkeypatch.setenv(kernels.SMALL_OPS_ENV, "fast")
    with pytest.raises(ValueError, match="WARMSTART_CPU_SMALL_OPS='fast' is not one of kernel, torch"):
        select_ops(cpu, torch.bfloat16)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_in_bfloat16_gives_the_same_tokens_on_either_path(
    family: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """In bfloat16 the kernels round like the reference, so greedy decoding follows the same tokens."""
    model_dir: Path = tiny_model_dir(family)
    prompts = [[3, 17, 42, 99, 5, 8, 13, 21, 34] * 4, [7, 1, 2]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fused = LLM.from_hf(model_dir, dtype="bfloat16")
    assert fused.engine.runner.model.ops.small_ops_kernel  # type: ignore[attr-defined]
    ours = [o.token_ids for o in fused.generate(prompts, params)]
    monkeypatch.setenv(kernels.SMALL_OPS_ENV, "torch")
    reference = LLM.from_hf(model_dir, dtype="bfloat16")
    assert not reference.engine.runner.model.ops.small_ops_kernel  # type: ignore[attr-defined]
    assert ours == [o.token_ids for o in reference.generate(prompts, params)]
