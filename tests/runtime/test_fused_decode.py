"""A decode step's layers in one C call (runtime/models/fused_decode.py over runtime/kernels/cpu_gemv.c) against
the ordinary ops (runtime/layers/), on each of the kernel's instruction sets up to the one in use (AVX2, AVX-512,
AVX512-BF16: isa.lowered), and the cases where it steps aside for them (below AVX2 among them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.reference import assert_close_in_bf16
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.kernels import cpu_gemv, isa
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata
from warmstart.runtime.layers.linear import plain_weight
from warmstart.runtime.models.fused_decode import FUSED_ENV, MAX_ROWS, FusedDecode
from warmstart.runtime.models.quantize import quantize_model

pytestmark = pytest.mark.skipif(cpu_gemv._ext is None, reason="no gemv kernel here (built without a C compiler)")
# the levels up to the one in use (WARMSTART_CPU_ISA=avx2 stops at avx2, as an AVX2 machine would) at which the
# kernel runs: avx2 and above
KERNEL_LEVELS = [level for level in isa.LEVELS[: isa.LEVELS.index(isa.chosen()) + 1]
                 if isa.LEVELS.index(level) >= isa.LEVELS.index("avx2")]  # fmt: skip
BF16 = torch.bfloat16


@pytest.fixture(params=KERNEL_LEVELS)
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every kernel runs at each of the gemv kernel's levels for the test (the models are loaded inside it, so they
    choose their paths there)."""
    with isa.lowered(request.param):
        assert cpu_gemv.cpu_supported()
        yield request.param


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def within_bf16_units(ours: torch.Tensor, reference: torch.Tensor, units: int) -> None:
    """Equal but where an RMSNorm's sum of squares, added in another order, moved a rounding: a few bf16 units."""
    assert ours.dtype == reference.dtype == BF16 and ours.shape == reference.shape
    unit = reference.float().abs().clamp(min=2.0**-20) * 2.0**-7
    excess = (ours.float() - reference.float()).abs() - units * unit
    assert excess.max() <= 0, f"worst excess {excess.max().item()}"


def decode_step(rows: int, num_layers: int, kv_heads: int, head_dim: int, seed: int) -> tuple:  # type: ignore[type-arg]
    """A decode step of ``rows`` sequences at different positions, each over its own blocks of a random pool."""
    block_size, per_row = 16, 4
    positions = torch.tensor([5, 40, 17, 63, 30, 8, 50, 61][:rows])
    tables = torch.arange(rows * per_row, dtype=torch.int64).view(rows, per_row).flip(1).contiguous()  # not in order
    slots = tables.gather(1, (positions // block_size)[:, None]).flatten() * block_size + positions % block_size
    group = AttentionGroup(torch.arange(rows), tables, positions, 0, is_decode=True, block_size=block_size)
    caches = [bf16(2, kv_heads, rows * per_row, block_size, head_dim, seed=seed + i) for i in range(num_layers)]
    tokens = torch.tensor([11, 3, 250, 77, 5, 19, 100, 42][:rows])
    return tokens, positions, caches, AttentionMetadata(slots, [group]), torch.arange(rows), slots


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_step_matches_the_ops(  # type: ignore[no-untyped-def]
    family: str, rows: int, level: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole step in one call against the model's ordinary ops on the same step: logits, and the pool (the new
    rows written at their slots, every other row untouched). GQA, a sliding window shorter than the context
    (mistral: 24) and a qkv bias (qwen2); rows at positions in other blocks, tables not in block order. The
    ordinary ops' linears take the same gemv kernel for every row count here, so sums differ in order only in
    the norms and attention."""
    monkeypatch.setattr(cpu_gemv, "MAX_ROWS", MAX_ROWS)
    model = LLM.from_hf(tiny_model_dir(family), dtype="bfloat16").engine.runner.model
    c = model.config
    assert model.fused_decode is not None
    tokens, positions, caches, meta, logits_index, slots = decode_step(rows, c.num_layers, c.num_kv_heads,
                                                                       c.head_dim, seed=20)  # fmt: skip
    reference_caches = [cache.clone() for cache in caches]
    called: list[int] = []
    logits = FusedDecode.logits
    model.fused_decode.logits = lambda *a: called.append(1) or logits(model.fused_decode, *a)  # type: ignore[method-assign]
    ours = model.forward(tokens, positions, caches, meta, logits_index)
    assert called
    model.fused_decode.enabled = False
    reference = model.forward(tokens, positions, reference_caches, meta, logits_index)
    # one bf16 unit of a rotated key (the two rotaries round alike but for ties) moves logits of scale 7 by up to
    # 0.13 two layers on; a wrong key range, slot or head moves them by their spread (about 2)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0.03 * float(reference.abs().max()))
    assert (ours - reference).abs().mean() < 0.01 * reference.std()
    for cache, reference_cache in zip(caches, reference_caches, strict=True):
        written = cache.view(2, c.num_kv_heads, -1, c.head_dim)[:, :, slots]
        expected = reference_cache.view(2, c.num_kv_heads, -1, c.head_dim)[:, :, slots]
        torch.testing.assert_close(written, expected, rtol=0, atol=0.03 * float(expected.abs().max()))
        untouched = torch.ones(cache[0, 0].numel() // c.head_dim, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(cache.view(2, c.num_kv_heads, -1, c.head_dim)[:, :, untouched],
                           reference_cache.view(2, c.num_kv_heads, -1, c.head_dim)[:, :, untouched])


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_head_in_the_call_equals_the_separate_ops(rows: int, level: str, tiny_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The final norm and the LM head inside the one call give, bit for bit, the logits that the model's own
    ``_logits`` gives on the call's output (the same norm and gemv code: the ops take the gemv for every row count
    here). A step that wants some rows' logits only, or whose head the kernel cannot read, takes the separate ops."""
    monkeypatch.setattr(cpu_gemv, "MAX_ROWS", MAX_ROWS)
    engine = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16").engine
    if engine.prepack_thread is not None:  # it swaps the weights in place, and this test swaps the head below
        engine.prepack_thread.join()
    model = engine.runner.model
    c, fused = model.config, model.fused_decode
    assert fused is not None
    tokens, positions, caches, meta, logits_index, _ = decode_step(rows, c.num_layers, c.num_kv_heads, c.head_dim,
                                                                   seed=40)  # fmt: skip
    x = model.weights.embed[tokens]
    ours = fused.logits(x.clone(), positions, [cache.clone() for cache in caches], meta)
    separate = model._logits(fused.run(x.clone(), positions, [cache.clone() for cache in caches], meta), logits_index)
    assert ours is not None and ours.dtype == torch.float32 and torch.equal(ours, separate)

    def not_called(*args: object) -> None:
        raise AssertionError("the head in the call served a step it should not have")

    monkeypatch.setattr(fused, "logits", not_called)
    some = logits_index[-1:] if rows > 1 else logits_index[:0]
    assert torch.equal(model.forward(tokens, positions, [cache.clone() for cache in caches], meta, some), ours[some])
    monkeypatch.undo()
    head = plain_weight(model.weights.lm_head)
    assert head is not None
    model.weights.lm_head = head.t().contiguous().t()  # the same matrix, column-major: not for the kernel
    assert fused.logits(x.clone(), positions, [cache.clone() for cache in caches], meta) is None
    fallback = model.forward(tokens, positions, [cache.clone() for cache in caches], meta, logits_index)
    torch.testing.assert_close(fallback, ours, rtol=0, atol=0.01 * float(ours.abs().max()))


def test_the_window_is_what_keeps_the_step_with_the_ops(  # type: ignore[no-untyped-def]
    level: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mistral's window (24) reaches the C attention: with the key ranges' starts forced to 0 the step parts from
    the ordinary ops' at positions 40 and 63 by far more than the tolerance above, and not at position 5."""
    model = LLM.from_hf(tiny_model_dir("mistral"), dtype="bfloat16").engine.runner.model
    c = model.config
    assert model.fused_decode is not None and set(c.sliding_windows) == {24}
    step = decode_step(4, c.num_layers, c.num_kv_heads, c.head_dim, seed=30)
    model.fused_decode.enabled = False
    reference = model.forward(*step[:2], [cache.clone() for cache in step[2]], *step[3:5])
    model.fused_decode.enabled = True
    step[3].groups[0].key_ranges.clear()
    key_range = AttentionGroup.key_range

    def no_window(group: AttentionGroup, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = key_range(group, window)
        return torch.zeros_like(start), end

    monkeypatch.setattr(AttentionGroup, "key_range", no_window)
    unwindowed = model.forward(*step[:2], [cache.clone() for cache in step[2]], *step[3:5])
    gap = (unwindowed - reference).abs().amax(dim=1)
    assert gap[0] < 0.03 * float(reference.abs().max())  # position 5: all of its keys are in the window anyway
    assert (gap[[1, 3]] > 0.1 * float(reference.abs().max())).all()


def decode_meta(rows: int, prefill: bool = False) -> AttentionMetadata:
    tables = torch.zeros(1 if prefill else rows, 1, dtype=torch.int64)
    group = AttentionGroup(slice(0, rows), tables, torch.zeros(rows), 0, is_decode=not prefill, block_size=16)
    return AttentionMetadata(torch.arange(rows), [group])


def test_serves_decode_rows_only(level: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16").engine.runner.model
    fused = model.fused_decode
    assert fused is not None
    assert fused.serves(1, decode_meta(1)) and fused.serves(MAX_ROWS, decode_meta(MAX_ROWS))
    assert not fused.serves(MAX_ROWS + 1, decode_meta(MAX_ROWS + 1))
    assert not fused.serves(3, decode_meta(3, prefill=True))
    split = decode_meta(2)  # decode rows in two groups (the PyTorch attention's split by length): not one call's
    split.groups = [decode_meta(1).groups[0], decode_meta(1).groups[0]]
    assert not fused.serves(2, split)
    fused.enabled = False
    assert not fused.serves(1, decode_meta(1))


def test_steps_aside_where_it_does_not_serve(level: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    def fused_for(family: str, dtype: str = "bfloat16") -> FusedDecode | None:
        return LLM.from_hf(tiny_model_dir(family), dtype=dtype).engine.runner.model.fused_decode

    assert fused_for("qwen2") is not None  # qkv bias: served
    assert fused_for("llama", "float32") is None  # float32: the transformers comparison's arithmetic
    assert fused_for("qwen3") is None  # q/k norms
    # plain weights to quantize (prepacking swaps them from a background thread)
    model = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16", prepack_weights=False).engine.runner.model
    assert FusedDecode.for_model(model.config, model.weights, model.rotary, sharded=True) is None
    int8 = quantize_model(model.weights, "int8")
    assert FusedDecode.for_model(model.config, int8, model.rotary, sharded=False) is None
    monkeypatch.setenv("WARMSTART_CPU_ATTENTION", "torch")  # its attention is the C decode kernel's
    assert fused_for("llama") is None
    monkeypatch.delenv("WARMSTART_CPU_ATTENTION")
    monkeypatch.setenv(FUSED_ENV, "torch")
    assert fused_for("llama") is None
    monkeypatch.setenv(FUSED_ENV, "on")
    with pytest.raises(ValueError, match="WARMSTART_CPU_FUSED_DECODE='on' is not one of kernel, torch"):
        fused_for("llama")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_decodes_close_to_the_reference(  # type: ignore[no-untyped-def]
    family: str, level: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 sums in another order than oneDNN's can part two greedy runs late: the first tokens agree, and the
    chosen tokens' logprobs stay within 0.05 of the reference path's while the runs agree."""
    model_dir: Path = tiny_model_dir(family)
    prompts = [[3, 17, 42, 99, 5, 8, 13, 21, 34] * 4, [7, 1, 2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM.from_hf(model_dir, dtype="bfloat16")
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    steps_run: list[int] = []
    logits = FusedDecode.logits
    monkeypatch.setattr(FusedDecode, "logits", lambda self, x, *a: steps_run.append(x.shape[0]) or logits(self, x, *a))
    ours = llm.generate(prompts, params)
    assert steps_run and set(steps_run) <= {1, 2}
    model.fused_decode.enabled = False
    model.ops.gemv_kernel = False  # type: ignore[attr-defined]
    reference = llm.generate(prompts, params)
    assert_close_in_bf16(ours, reference)


def test_a_step_with_lora_takes_the_ordinary_ops(level: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
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
    monkeypatch.setattr(FusedDecode, "_call", no_fused_layer)
    assert model.forward(*step, lora=object()).shape == with_lora.shape  # type: ignore[arg-type]
    torch.testing.assert_close(fused_logits, with_lora, rtol=0.05, atol=0.05)


def test_the_step_reads_the_plain_weights_the_layers_hold_now(level: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Its pointer table follows a swap of a packed weight's plain tensor (prepacking's huge-page copy does that from
    its thread): after the swap the step reads the new tensor, and back again the old one."""
    llm = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16")
    assert llm.engine.prepack_thread is not None
    llm.engine.prepack_thread.join()
    model = llm.engine.runner.model
    c = model.config
    step = decode_step(1, c.num_layers, c.num_kv_heads, c.head_dim, seed=40)[:5]  # one pool: the table stays put
    before = model.forward(*step)
    packed = model.weights.layers[0].down
    original = plain_weight(packed)
    assert original is not None
    packed.weight = torch.zeros_like(original)  # type: ignore[union-attr]
    zeroed = model.forward(*step)
    packed.weight = original  # type: ignore[union-attr]
    assert not torch.equal(zeroed, before)
    assert torch.equal(model.forward(*step), before)


def test_below_avx2_the_engine_takes_the_ordinary_ops(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """At portable (an ARM machine, or WARMSTART_CPU_ISA=portable) a model has no fused step and its linears take
    the PyTorch path: it decodes (a call into the kernel would raise there, as the C call shows), close to the fused
    path of the level in use. Close within 0.1, not the 0.05 of the same-level comparisons: the level also moves the
    prefill (oneDNN packs float32 below AVX512-BF16, other attention paths), by up to 0.056 measured here."""
    model_dir: Path = tiny_model_dir("llama")
    prompts = [[3, 17, 42, 99, 5, 8, 13, 21, 34] * 4, [7, 1, 2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    with isa.lowered("portable"):
        assert not cpu_gemv.cpu_supported()
        llm = LLM.from_hf(model_dir, dtype="bfloat16")
        model = llm.engine.runner.model
        assert model.fused_decode is None and not model.ops.gemv_kernel  # type: ignore[attr-defined]
        ours = llm.generate(prompts, params)
        assert cpu_gemv._ext is not None
        with pytest.raises(RuntimeError, match="decode_layers: the kernel needs AVX2 .* run at 'portable'"):
            cpu_gemv._ext.decode_layers(0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 64, 4, 2, 16, 128, 16, 1, 0, 1e-5, 1, 0, 0, 0,
                                        0)  # fmt: skip
    if KERNEL_LEVELS:
        fused = LLM.from_hf(model_dir, dtype="bfloat16")
        assert fused.engine.runner.model.fused_decode is not None
        assert_close_in_bf16(ours, fused.generate(prompts, params), logprob_tol=0.1)
