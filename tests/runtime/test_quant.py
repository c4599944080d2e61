"""Weight-only quantization: error bounds, kernels against the dequantized matrix, the snapshot round trip
through raw bytes, shapes that do not fit, and quantized models in the engine."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import msgpack
import pytest
import torch
import torch.nn.functional as F

from benchmarks.quant_eval import compare_to_float
from warmstart.runtime import LLM, EngineOptions, LLMEngine, SamplingParams
from warmstart.runtime.layers.linear import linear
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.model import Model
from warmstart.runtime.models.quantize import quantize_model
from warmstart.runtime.models.weights import LINEAR_FIELDS, LayerWeights, ModelWeights, load_weights
from warmstart.runtime.quant import formats as quant
from warmstart.runtime.quant.quantize import quantize
from warmstart.runtime.tokenizer import Tokenizer

ModelDir = Callable[[str], pathlib.Path]
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def weight(n: int = 160, k: int = 256, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    w = randn(n, k, seed=seed) / k**0.5
    w[3] = 0  # an all-zero row (and group) must not divide by zero
    w[5, :40] *= 50  # an outlier group
    return w.to(dtype)


def quantized(w: torch.Tensor, scheme: str, group_size: int | None = None) -> quant.QuantizedWeight:
    q = quantize(w, scheme, group_size)
    assert isinstance(q, quant.QuantizedWeight)
    return q


def nf4_reference(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and dequantized weights straight from the definition: nearest code-book value of w / absmax."""
    g = w.float().view(w.shape[0], -1, block)
    absmax = g.abs().amax(-1, keepdim=True)
    absmax = torch.where(absmax > 0, absmax, 1.0)
    codes = ((g / absmax)[..., None] - quant.NF4_CODE).abs().argmin(-1)
    return codes.view(w.shape), (quant.NF4_CODE[codes] * absmax).view(w.shape)


def pack_int4(codes: torch.Tensor, layout: str) -> torch.Tensor:
    """[N, K] codes in 0..15 -> bytes in ``layout`` (the inverse of the runtime's unpacking)."""
    block, kind = quant.INT4_LAYOUTS[layout]
    n, k = codes.shape
    out = []
    for r0 in range(0, n, block):
        rows = codes[r0 : r0 + block].t()  # [K, rows]
        half = rows.shape[1] // 2
        lo, hi = (rows[:, :half], rows[:, half:]) if rows.shape[1] == block and kind == "halves" else (
            rows[:, 0::2], rows[:, 1::2])
        out.append((lo | hi << 4).reshape(-1))
    return torch.cat(out).to(torch.uint8).view(n, k // 2)


def through_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` made the way a snapshot loader makes it: raw bytes, then a typed view of a buffer."""
    raw = bytearray(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape)


# -- error bounds ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_error_is_at_most_half_a_scale(dtype: torch.dtype) -> None:
    w = weight(dtype=dtype)
    q = quantized(w, "int8")
    assert isinstance(q, quant.Int8Weight)
    assert q.qweight.dtype == torch.int8 and q.scales.dtype == dtype and q.qweight.abs().max() <= 127
    err = (q.dequantize() - w.float()).abs()
    assert (err <= q.scales.float()[:, None] / 2).all()
    assert (q.dequantize()[3] == 0).all()


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_error_is_at_most_half_a_step(dtype: torch.dtype, group_size: int) -> None:
    w = weight(dtype=dtype)
    q = quantized(w, "int4", group_size)
    assert isinstance(q, quant.Int4Weight) and q.group_size == group_size
    scale, zero = q.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, groups]
    err = (q.dequantize() - w.float()).abs().view(w.shape[0], -1, group_size)
    # Exactly half a step with float32 scales; bf16 rounds the stored zero and scale (relative 2**-9), which
    # may push a group's extreme value half a rounding further.
    slack = 0.0 if dtype == torch.float32 else 0.02
    bound = scale * (0.5 + slack) + zero.abs() * slack + 1e-6
    assert (err <= bound[..., None]).all()
    assert err.max() > 0.3 * scale.max()  # not vacuous: the error is a sizeable part of a step


def test_nf4_matches_a_reference_quantization_from_the_code_book() -> None:
    w = weight()
    q = quantized(w, "nf4")
    assert isinstance(q, quant.NF4Weight) and q.group_size == 64  # the default block
    codes, expected = nf4_reference(w, 64)
    # Two codes a byte, the first in the high nibble (as bitsandbytes packs them).
    assert torch.equal(q.packed, (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8))
    torch.testing.assert_close(q.dequantize(), expected, rtol=0, atol=0)
    gaps = (quant.NF4_CODE[1:] - quant.NF4_CODE[:-1]).max() / 2
    absmax = w.view(w.shape[0], -1, 64).abs().amax(-1, keepdim=True)
    assert ((q.dequantize() - w).abs().view(w.shape[0], -1, 64) <= absmax * gaps + 1e-7).all()


def test_bf16_nf4_uses_its_stored_absmax() -> None:
    w = weight(dtype=torch.bfloat16)
    q = quantized(w, "nf4", 32)
    assert isinstance(q, quant.NF4Weight) and q.absmax.dtype == torch.bfloat16
    u = torch.stack((q.packed >> 4, q.packed & 15), -1).view(w.shape[0], -1, 32).long()
    expected = (quant.NF4_CODE[u] * q.absmax.float()[..., None]).view(w.shape)
    torch.testing.assert_close(q.dequantize(), expected, rtol=0, atol=0)


# -- kernels ----------------------------------------------------------------------------------------------------

SCHEMES = ["int8", "int4", "nf4"]


def assert_linear_matches(q: quant.QuantizedWeight, y: torch.Tensor, x: torch.Tensor) -> None:
    expected = F.linear(x.float(), q.dequantize())
    assert y.dtype == x.dtype and y.shape == expected.shape
    # bf16: the output's own rounding plus, on converted paths, weights rounded to bf16.
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))


@pytest.mark.parametrize("rows", [1, 7, 33, 97])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_linear_equals_the_dequantized_matmul(scheme: str, dtype: torch.dtype, rows: int) -> None:
    q = quantized(weight(dtype=dtype), scheme, 32)
    x = randn(rows, 256, seed=rows, dtype=dtype)
    assert_linear_matches(q, linear(x, q), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_fused_kernel_and_converted_path_agree(scheme: str, dtype: torch.dtype) -> None:
    q = quantized(weight(dtype=dtype), scheme, 64)
    assert isinstance(q, quant.Int8Weight | quant.Int4Weight)
    x = randn(7, 256, seed=1, dtype=dtype)
    assert_linear_matches(q, q.fused(x), x)
    assert_linear_matches(q, q.converted(x), x)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tiles_give_the_same_result_as_one_matmul(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q = quantized(weight(n=208, dtype=torch.bfloat16), scheme, 32)  # 208 = 3 blocks of 64 and one of 16
    x = randn(70, 256, dtype=torch.bfloat16)
    whole = linear(x, q)
    monkeypatch.setattr(quant, "TILE_ELEMENTS", 64 * 256)  # 64-row tiles, the last one partial
    assert torch.equal(linear(x, q), whole)


def test_linear_keeps_leading_dims_adds_bias_and_takes_no_rows() -> None:
    q = quantized(weight(), "int8")
    x, bias = randn(2, 3, 256), randn(160, seed=1)
    expected = F.linear(x, q.dequantize(), bias)
    torch.testing.assert_close(linear(x, q, bias), expected, rtol=1e-5, atol=1e-5)
    assert linear(randn(0, 256), q).shape == (0, 160)
    w = weight()
    assert torch.equal(linear(x, w, bias), F.linear(x, w, bias))  # float weights: F.linear itself


def test_int8_bf16_in_features_not_a_multiple_of_16_avoid_the_kernel() -> None:
    # torch's bf16 _weight_int8pack_mm computes garbage (or crashes) for such shapes: the converted path runs.
    q = quantized(weight(n=32, k=40, dtype=torch.bfloat16), "int8")
    x = randn(3, 40, dtype=torch.bfloat16)
    assert_linear_matches(q, linear(x, q), x)


# -- snapshots: tensors, meta, from_tensors ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_rebuilt_from_raw_bytes_computes_the_same(scheme: str, dtype: torch.dtype) -> None:
    q = quantized(weight(dtype=dtype), scheme, 32)
    meta = msgpack.unpackb(msgpack.packb(q.meta()))  # what a manifest keeps
    views = {name: through_bytes(t) for name, t in q.tensors().items()}
    rebuilt = quant.from_tensors(meta, views)
    assert type(rebuilt) is type(q) and rebuilt.meta() == q.meta() and rebuilt.nbytes == q.nbytes
    for name, t in rebuilt.tensors().items():  # zero-copy: the rebuilt weight holds the views themselves
        assert t.data_ptr() == views[name].data_ptr()
    for rows in (1, 33, 97):
        x = randn(rows, 256, seed=rows, dtype=dtype)
        assert torch.equal(linear(x, rebuilt), linear(x, q))


def test_int4_packed_for_another_cpu_is_repacked_on_load() -> None:
    local = quant.int4_layout()
    assert local is not None, "PyTorch's CPU int4 kernel should be usable here"
    q = quantized(weight(n=208), "int4", 32)
    assert isinstance(q, quant.Int4Weight) and q.layout == local
    codes = quant._int4_codes_t(q.packed, 208, 256, local).t()
    assert torch.equal(pack_int4(codes, local), q.packed)  # our reading of the layout is PyTorch's packing
    x = randn(5, 256)
    for other in quant.INT4_LAYOUTS:
        foreign = {"packed": pack_int4(codes, other), "scales_zeros": q.scales_zeros}
        rebuilt = quant.from_tensors({**q.meta(), "layout": other}, foreign)
        assert isinstance(rebuilt, quant.Int4Weight) and rebuilt.layout == local
        assert torch.equal(rebuilt.packed, q.packed) and torch.equal(linear(x, rebuilt), linear(x, q))


def test_from_tensors_refuses_what_does_not_fit_its_meta() -> None:
    q = quantized(weight(), "nf4")
    tensors = q.tensors()
    with pytest.raises(ValueError, match="unknown quantization scheme 'fp3'"):
        quant.from_tensors({**q.meta(), "scheme": "fp3"}, tensors)
    with pytest.raises(ValueError, match="no 'absmax' tensor"):
        quant.from_tensors(q.meta(), {"packed": tensors["packed"]})
    with pytest.raises(ValueError, match=r"'packed' is torch.uint8 \(160, 64\), expected torch.uint8 \(160, 128\)"):
        quant.from_tensors(q.meta(), {**tensors, "packed": tensors["packed"][:, :64]})
    with pytest.raises(ValueError, match="unknown int4 layout 'neon'"):
        quant.from_tensors({**quantized(weight(), "int4").meta(), "layout": "neon"}, tensors)


# -- shapes and options --------------------------------------------------------------------------------------------


def test_group_size_that_does_not_divide_in_features_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="layers.3.down: in_features 96 is not a multiple of the int4 group size 64"):
        quantize(weight(k=96), "int4", 64, name="layers.3.down")
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of the nf4 group size 64"):
        quantize(weight(k=96), "nf4", 64)
    with pytest.raises(ValueError, match="out_features 40 is not a multiple of 16"):
        quantize(weight(n=40), "int4", 32)
    with pytest.raises(ValueError, match="group size must be one of 32, 64, 128, 256, got 48"):
        quantize(weight(), "int4", 48)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        quantize(weight(), "int3")
    assert quantize(weight(k=96), "int8").shape == (160, 96)  # int8 has no groups
    w = weight()
    assert quantize(w, "none") is w


def tiny_weights(tiny_model_dir: ModelDir, family: str, dtype: torch.dtype) -> tuple[ModelConfig, ModelWeights]:
    model_dir = tiny_model_dir(family)
    config = ModelConfig.from_dir(model_dir)
    return config, load_weights(model_dir, config, dtype)


def test_quantize_model_names_every_misfit_and_the_group_sizes_that_fit(tiny_model_dir: ModelDir) -> None:
    _, weights = tiny_weights(tiny_model_dir, "llama", torch.float32)  # hidden 96
    fits = r"group size 128: layers.0.qkv: in_features 96 .*\(group sizes that fit: 32\)"
    with pytest.raises(ValueError, match=fits):
        quantize_model(weights, "int4", 128)
    _, weights = tiny_weights(tiny_model_dir, "llama2_linear", torch.float32)  # intermediate 176 = 11 * 16
    with pytest.raises(ValueError, match=r"layers.0.down: in_features 176 .*\(no group size fits; use int8\)"):
        quantize_model(weights, "nf4")


def test_default_group_size_is_the_largest_that_fits(tiny_model_dir: ModelDir) -> None:
    _, weights = tiny_weights(tiny_model_dir, "qwen3", torch.float32)  # in_features 64, 128 and 160
    q = quantize_model(weights, "int4")
    assert {m["group_size"] for m in q.quant_meta().values()} == {32}
    assert quantize(weight(k=576), "int4").meta()["group_size"] == 64  # type: ignore[union-attr]
    assert quantize(weight(k=512), "int4").meta()["group_size"] == 128  # type: ignore[union-attr]
    assert quantize(weight(k=512), "nf4").meta()["group_size"] == 64  # type: ignore[union-attr]


@pytest.mark.parametrize("quantize_head", [False, True])
def test_quantized_weights_list_their_parts_and_meta(tiny_model_dir: ModelDir, quantize_head: bool) -> None:
    _, weights = tiny_weights(tiny_model_dir, "qwen2", torch.float32)  # tied head, qkv bias
    q = quantize_model(weights, "int8", quantize_head=quantize_head)
    names = q.tensors()
    assert "layers.1.qkv.qweight" in names and "layers.1.qkv.scales" in names and "layers.1.qkv" not in names
    assert torch.equal(names["layers.1.qkv_bias"], weights.layers[1].qkv_bias)  # type: ignore[arg-type]
    assert names["embed"] is weights.embed and "layers.0.input_norm" in names
    linears = {f"layers.{i}.{f}" for i in range(2) for f in LINEAR_FIELDS}
    assert set(q.quant_meta()) == linears | ({"lm_head"} if quantize_head else set())
    assert ("lm_head.qweight" in names) == quantize_head and "lm_head" not in names  # tied float head: embed
    assert weights.quant_meta() == {}
    with pytest.raises(ValueError, match="layers.0.qkv is already quantized"):
        quantize_model(q, "int8")


# -- the engine ----------------------------------------------------------------------------------------------


def rebuilt_from_snapshot_parts(weights: ModelWeights) -> ModelWeights:
    """What the snapshot loader does: every tensor through raw bytes, quantized ones rebuilt from their meta."""
    tensors = {name: through_bytes(t) for name, t in weights.tensors().items()}
    meta = weights.quant_meta()

    def get(name: str) -> torch.Tensor | quant.QuantizedWeight | None:
        if name in meta:
            return quant.from_tensors(meta[name], {k[len(name) + 1 :]: t for k, t in tensors.items()
                                                   if k.startswith(name + ".")})
        return tensors.get(name)

    layers = [LayerWeights(**{f.name: get(f"layers.{i}.{f.name}") for f in dataclasses.fields(LayerWeights)})
              for i in range(len(weights.layers))]
    head = get("lm_head")
    return ModelWeights(tensors["embed"], layers, tensors["norm"], tensors["embed"] if head is None else head)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_model_generates_and_survives_the_snapshot_round_trip(tiny_model_dir: ModelDir, scheme: str) -> None:
    config, weights = tiny_weights(tiny_model_dir, "qwen2", torch.bfloat16)  # tied head, qkv bias
    tokenizer = Tokenizer(tiny_model_dir("qwen2"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Once upon a time, in a small village by the sea", "Hello"]
    outputs = []
    quantized_weights = quantize_model(weights, scheme)
    for w in (quantized_weights, rebuilt_from_snapshot_parts(quantized_weights)):
        engine = LLMEngine.from_weights(config, w, tokenizer, EngineOptions(dtype="bfloat16", num_kv_blocks=64))
        outputs.append([o.token_ids for o in LLM(engine).generate(prompts, params)])
    assert all(len(t) == 12 for t in outputs[0])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_experts_generate_and_survive_the_snapshot_round_trip(tiny_model_dir: ModelDir, scheme: str) -> None:
    """A Mixture-of-Experts layer's experts, each quantized alone and stored stacked, one tensor per part."""
    config, weights = tiny_weights(tiny_model_dir, "mixtral", torch.bfloat16)
    quantized = quantize_model(weights, scheme)
    experts = quantized.layers[0].experts_gate_up
    assert isinstance(experts, quant.QuantizedExperts) and len(experts.experts) == 4
    assert all(e.scheme == scheme for e in experts.experts)
    stacked = experts.tensors()
    assert all(t.shape[0] == 4 for t in stacked.values()) and experts.meta()["expert"]["scheme"] == scheme
    gate_up = weights.layers[0].experts_gate_up
    assert isinstance(gate_up, torch.Tensor)
    assert torch.equal(experts.dequantize(torch.float32)[2], experts.experts[2].dequantize(torch.float32))
    tokenizer = Tokenizer(tiny_model_dir("mixtral"))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Once upon a time, in a small village by the sea", "Hello"]
    outputs = []
    for w in (quantized, rebuilt_from_snapshot_parts(quantized)):
        engine = LLMEngine.from_weights(config, w, tokenizer, EngineOptions(dtype="bfloat16", num_kv_blocks=64))
        outputs.append([o.token_ids for o in LLM(engine).generate(prompts, params)])
    assert all(len(t) == 10 for t in outputs[0]) and outputs[0] == outputs[1]
    float_weights = tiny_weights(tiny_model_dir, "mixtral", torch.float32)[1]
    g = torch.Generator().manual_seed(0)
    prompts_ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 17, 30, 12, 21)]
    report = compare_to_float(Model(config, float_weights, 256),
                              Model(config, quantize_model(float_weights, scheme), 256), prompts_ids)
    # deterministic figures: int8 0.97 of top tokens and 12.5 of 16 greedy tokens; int4 (groups of 32 on a random
    # model: coarse) 0.55, a mean logit error of 0.61 against logits of std ~2
    if scheme == "int8":
        assert report["top1_agreement"] >= 0.9 and report["mean_matching_prefix"] >= 0.5 * report["max_tokens"]
    else:
        assert 0.1 < report["mean_abs_logit_diff"] < 1.0


PROMPT_LENGTHS = (5, 9, 17, 30, 3, 12, 40, 21)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_stays_close_to_the_float_model(tiny_model_dir: ModelDir, family: str) -> None:
    """Everything here is deterministic (seed-0 weights, no randomness in quantizing, greedy decoding, one
    torch thread), so the figures cannot flake; they are llama 0.96 / 12.25 and qwen2 0.96 / 10.6, and the
    thresholds leave room for legitimate numeric changes. Random tiny models are chaotic: one flipped token
    changes every later one, hence a mean matching prefix rather than whole-sequence agreement."""
    config, weights = tiny_weights(tiny_model_dir, family, torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    float_model = Model(config, weights, 256)
    report = compare_to_float(float_model, Model(config, quantize_model(weights, "int8"), 256), prompts)
    assert report["top1_agreement"] >= 0.9
    assert report["mean_matching_prefix"] >= 0.5 * report["max_tokens"]
    assert 0 < report["max_abs_logit_diff"] < 2.0  # logits have std ~2 in these models
    same = compare_to_float(float_model, float_model, prompts)
    assert same["max_abs_logit_diff"] == 0 and same["greedy_agreement"] == 1 and same["top1_agreement"] == 1
    int4 = compare_to_float(float_model, Model(config, quantize_model(weights, "int4"), 256), prompts)
    assert int4["mean_abs_logit_diff"] > 5 * report["mean_abs_logit_diff"]  # 4 bits are visibly coarser


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4"])
def test_scratch_buffers_made_under_inference_mode_serve_outside_it(scheme: str) -> None:
    """The per-thread scratch buffers are first made by whichever call comes first; an engine step runs
    under inference mode, a caller outside it must still be able to use them."""
    import threading

    w = quantize(weight(), scheme, 64 if scheme != "int8" else None)
    x = randn(3, 256, seed=1)
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def run() -> None:  # a new thread: no scratch buffers yet
        try:
            with torch.inference_mode():
                results.append(linear(x, w).clone())
            results.append(linear(x, w))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    torch.testing.assert_close(results[0], results[1])
