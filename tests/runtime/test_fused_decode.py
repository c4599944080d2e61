"""A decode layer in C calls (runtime/models/fused_decode.py over runtime/kernels/cpu_gemv.c) against the ordinary
ops (runtime/layers/), and the cases where it steps aside for them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.kernels import cpu_gemv
from runtime.layers import norm
from runtime.layers.activation import silu_and_mul
from runtime.layers.attention import AttentionGroup, AttentionMetadata, write_kv
from runtime.layers.rotary import RotaryTables, apply_rotary, lookup
from runtime.models.fused_decode import FUSED_ENV, MAX_ROWS, FusedDecode
from runtime.models.quantize import quantize_model
from tests.support.reference import assert_close_in_bf16

pytestmark = pytest.mark.skipif(
    cpu_gemv._ext is None or not cpu_gemv.cpu_supported(), reason="no gemv kernel or no AVX512-BF16 here"
)
BF16 = torch.bfloat16


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def within_bf16_units(ours: torch.Tensor, reference: torch.Tensor, units: int) -> None:
    """Equal but where an RMSNorm's sum of squares, added in another order, moved a rounding: a few bf16 units."""
    assert ours.dtype == reference.dtype == BF16 and ours.shape == reference.shape
    unit = reference.float().abs().clamp(min=2.0**-20) * 2.0**-7
    excess = (ours.float() - reference.float()).abs() - units * unit
    assert excess.max() <= 0, f"worst excess {excess.max().item()}"


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_attention_half_matches_the_ops(rows: int, bias: bool) -> None:
    hidden, heads, kv_heads, head_dim, blocks, block_size = 96, 4, 2, 48, 6, 16
    x, norm_w = bf16(rows, hidden, seed=1, scale=3), (1 + 0.1 * bf16(hidden, seed=2)).to(BF16)
    n_qkv = (heads + 2 * kv_heads) * head_dim
    w, b = bf16(n_qkv, hidden, seed=3, scale=0.1), bf16(n_qkv, seed=4) if bias else None
    tables = RotaryTables(1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim), 1.0, 256, BF16)
    positions = torch.tensor([5, 100, 17, 255][:rows])
    slots = torch.tensor([3, 40, 77, 95][:rows])
    cache, reference_cache = (bf16(2, kv_heads, blocks, block_size, head_dim, seed=5) for _ in range(2))

    q = cpu_gemv.decode_attention_in(x, norm_w, 1e-5, w, b, tables.cos, tables.sin, positions, slots, cache, heads)

    qkv = cpu_gemv.gemv(norm.rms_norm(x, norm_w, 1e-5), w, b)  # the linear itself: tests/runtime/test_cpu_gemv.py
    rq, rk, rv = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    rq, rk = apply_rotary(rq.view(rows, heads, head_dim), rk.view(rows, kv_heads, head_dim),
                          *lookup(tables.cos, tables.sin, positions))
    write_kv(reference_cache, rk, rv.reshape(rows, kv_heads, head_dim), slots)
    within_bf16_units(q, rq, 2)
    within_bf16_units(cache, reference_cache, 2)  # the slots written, and every other one untouched
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache.view(2, kv_heads, -1, head_dim)[:, :, untouched],
                       reference_cache.view(2, kv_heads, -1, head_dim)[:, :, untouched])


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_mlp_half_matches_the_ops(rows: int) -> None:
    hidden, attn_width, inter = 96, 192, 256
    attn, x = bf16(rows, attn_width, seed=6), bf16(rows, hidden, seed=7, scale=3)
    o_w, post = bf16(hidden, attn_width, seed=8, scale=0.1), (1 + 0.1 * bf16(hidden, seed=9)).to(BF16)
    gate_up, down = bf16(2 * inter, hidden, seed=10, scale=0.1), bf16(hidden, inter, seed=11, scale=0.1)

    ours = cpu_gemv.decode_mlp(attn, o_w, x, post, 1e-5, gate_up, down)

    h, summed = norm.add_rms_norm(cpu_gemv.gemv(attn, o_w), x, post, 1e-5)
    reference = summed + cpu_gemv.gemv(silu_and_mul(cpu_gemv.gemv(h, gate_up)), down)
    within_bf16_units(ours, reference, 4)


def decode_meta(rows: int, prefill: bool = False) -> AttentionMetadata:
    group = AttentionGroup(slice(0, rows), torch.zeros(1, 1, dtype=torch.int64), torch.zeros(rows), 0,
                           is_decode=not prefill, block_size=16)
    return AttentionMetadata(torch.arange(rows), [group])


def test_serves_decode_rows_only(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16").engine.runner.model
    fused = model.fused_decode
    assert fused is not None
    assert fused.serves(1, decode_meta(1)) and fused.serves(MAX_ROWS, decode_meta(MAX_ROWS))
    assert not fused.serves(MAX_ROWS + 1, decode_meta(MAX_ROWS + 1))
    assert not fused.serves(3, decode_meta(3, prefill=True))
    fused.enabled = False
    assert not fused.serves(1, decode_meta(1))


def test_steps_aside_where_it_does_not_serve(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    def fused_for(family: str, dtype: str = "bfloat16") -> FusedDecode | None:
        return LLM.from_hf(tiny_model_dir(family), dtype=dtype).engine.runner.model.fused_decode

    assert fused_for("qwen2") is not None  # qkv bias: served
    assert fused_for("llama", "float32") is None  # float32: the transformers comparison's arithmetic
    assert fused_for("qwen3") is None  # q/k norms
    model = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16").engine.runner.model
    assert FusedDecode.for_model(model.config, model.weights, model.rotary, sharded=True) is None
    int8 = quantize_model(model.weights, "int8")
    assert FusedDecode.for_model(model.config, int8, model.rotary, sharded=False) is None
    monkeypatch.setenv(FUSED_ENV, "torch")
    assert fused_for("llama") is None
    monkeypatch.setenv(FUSED_ENV, "on")
    with pytest.raises(ValueError, match="WARMSTART_CPU_FUSED_DECODE='on' is not one of kernel, torch"):
        fused_for("llama")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_decodes_close_to_the_reference(family: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """bf16 sums in another order than oneDNN's can part two greedy runs late: the first tokens agree, and the
    chosen tokens' logprobs stay within 0.05 of the reference path's while the runs agree."""
    model_dir: Path = tiny_model_dir(family)
    prompts = [[3, 17, 42, 99, 5, 8, 13, 21, 34] * 4, [7, 1, 2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM.from_hf(model_dir, dtype="bfloat16")
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    layers_run: list[int] = []
    layer = FusedDecode.layer
    monkeypatch.setattr(FusedDecode, "layer", lambda self, i, *a: layers_run.append(i) or layer(self, i, *a))
    ours = llm.generate(prompts, params)
    assert layers_run and set(layers_run) == set(range(len(model.weights.layers)))
    model.fused_decode.enabled = False
    model.ops.gemv_kernel = False  # type: ignore[attr-defined]
    reference = llm.generate(prompts, params)
    assert_close_in_bf16(ours, reference)


def test_a_step_with_lora_takes_the_ordinary_ops(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The LoRA add hooks the ordinary linears (runtime/layers/lora.py), so a batch carrying adapters skips the path."""
    model = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16").engine.runner.model
    c = model.config
    caches = [torch.zeros(2, c.num_kv_heads, 1, 16, c.head_dim, dtype=BF16) for _ in model.weights.layers]
    meta = decode_meta(1)
    meta.groups[0].query_positions = torch.zeros(1, dtype=torch.int64)
    step = (torch.tensor([5]), torch.tensor([0]), caches, meta, torch.tensor([0]))

    def no_fused_layer(*args: object) -> torch.Tensor:
        raise AssertionError("the fused path ran")

    added: list[str] = []
    monkeypatch.setattr(model, "add_lora", lambda y, x, lora, i, module: added.append(module) or y)
    with_lora = model.forward(*step, lora=object())  # type: ignore[arg-type]
    assert added.count("qkv") == len(model.weights.layers)
    fused_logits = model.forward(*step)  # the same step without LoRA: the fused path, same logits within bf16
    monkeypatch.setattr(FusedDecode, "layer", no_fused_layer)
    assert model.forward(*step, lora=object()).shape == with_lora.shape  # type: ignore[arg-type]
    torch.testing.assert_close(fused_logits, with_lora, rtol=0.05, atol=0.05)
