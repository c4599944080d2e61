"""The CPU path's prepacked bf16 weights (packed as bf16, or widened to float32 where the CPU has no bf16 dot
products) give the same results and tokens as the plain weights do, bit for bit, so that no output depends on how far
the background packing has got."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.model_configs import FAMILIES
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.engine.model_runner import Chunk
from warmstart.runtime.kernels import isa
from warmstart.runtime.layers.linear import linear, packing_dtype, widens
from warmstart.runtime.quant.packed_linear import PackedWeight

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not available")

# float32 packing everywhere; bf16 packing where this CPU has bf16 dot products (and oneDNN packs bf16)
COMPUTE = [torch.float32] + ([torch.bfloat16] if packing_dtype(torch.bfloat16) == torch.bfloat16 else [])


@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_packed_linear_equals_f_linear(rows: int, compute: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen).bfloat16()
    x = torch.randn(rows, 80, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    packed = PackedWeight(w, compute)
    assert packed.shape == (96, 80) and packed.compute == compute
    y = packed.linear(x, bias)
    assert y.dtype == torch.bfloat16
    # one rounding to bf16 of float32 sums: within one bf16 step of F.linear's (the sums' order differs)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=0.01, atol=0.01)
    exact = (x.double() @ w.double().t() + bias.double()).to(torch.bfloat16)
    assert (y.float() - exact.float()).abs().max() <= exact.float().abs().max() * 2**-7


def test_packing_follows_the_instruction_set() -> None:
    assert packing_dtype(torch.float32) is None  # float32 keeps F.linear
    with isa.lowered("portable"):
        assert packing_dtype(torch.bfloat16) == torch.float32
    if isa.best() == "avx512_bf16":
        assert packing_dtype(torch.bfloat16) in (torch.bfloat16, torch.float32)  # float32 where oneDNN refuses
        with isa.lowered("avx2"):
            assert packing_dtype(torch.bfloat16) == torch.float32


@pytest.mark.parametrize("level", [lv for lv in isa.LEVELS if isa.LEVELS.index(lv) <= isa.LEVELS.index(isa.best())])
@pytest.mark.parametrize("rows", [7, 33])
def test_a_plain_weight_computes_as_its_packed_copy(rows: int, level: str) -> None:
    """Before the background packing reaches a weight, the plain one gives what the packed copy will: F.linear where
    packing keeps bf16 (oneDNN's own bf16 matmul), the packed copy's float32 arithmetic where packing widens."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(1536, 576, generator=gen).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    bias = torch.randn(1536, generator=gen).bfloat16()
    with isa.lowered(level):
        compute = packing_dtype(torch.bfloat16)
        assert widens(w) == (compute == torch.float32) and not widens(w.float())
        packed = PackedWeight(w, compute)
        for b in (None, bias):
            assert torch.equal(linear(x, w, b), packed.linear(x, b)), (level, compute, b is None)
        if compute == torch.float32 and rows == 33:  # F.linear's own bf16 matmul is not (so the test can fail)
            assert not torch.equal(torch.nn.functional.linear(x, w), packed.linear(x))


def engine(model_dir, prepack: bool) -> LLM:  # type: ignore[no-untyped-def]
    llm = LLM.from_hf(model_dir, dtype="bfloat16", num_kv_blocks=64, prepack_weights=prepack)
    if llm.engine.prepack_thread is not None:
        llm.engine.prepack_thread.join()
    packed = {type(layer.qkv).__name__ for layer in llm.engine.runner.model.weights.layers}
    assert packed == {"PackedWeight" if prepack else "Tensor"}
    return llm


def last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    blocks = -(-len(prompt) // llm.engine.options.block_size)
    return llm.engine.runner.forward([Chunk(list(range(blocks)), prompt, 0, 1)])[0].float()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prepacked_engine_generates_what_the_plain_one_does(tiny_model_dir, family: str) -> None:
    rng = random.Random(0)
    vocab = FAMILIES[family]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llms = {prepack: engine(tiny_model_dir(family), prepack) for prepack in (False, True)}
    for prompt in prompts:
        plain, packed = (last_logits(llms[prepack], prompt) for prepack in (False, True))
        assert torch.equal(packed, plain)
    outs = {prepack: [o.token_ids for o in llm.generate(prompts, params)] for prepack, llm in llms.items()}
    assert all(len(t) == 8 for t in outs[True]) and outs[True] == outs[False]


def test_serving_while_packing_gives_the_same_tokens(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Requests served while the weights are swapped for packed ones, layer by layer, come out as from an engine
    that never packed, and once packed the engine generates what one packed from the start does."""
    prompts = [[5, 6, 7, 8], list(range(10, 40))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = engine(tiny_model_dir("llama"), prepack=False)
    racing = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16", num_kv_blocks=64)  # packs as it serves
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in racing.generate(prompts, params)] == expected
    if racing.engine.prepack_thread is not None:
        racing.engine.prepack_thread.join()
    packed = [o.token_ids for o in engine(tiny_model_dir("llama"), prepack=True).generate(prompts, params)]
    assert packed == expected and [o.token_ids for o in racing.generate(prompts, params)] == packed
