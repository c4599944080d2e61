"""The CPU path's prepacked bf16 weights give the same tokens as plain F.linear."""

from __future__ import annotations

import random

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.quant.packed_linear import PackedWeight, can_prepack
from tests.support.model_configs import FAMILIES

pytestmark = pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="oneDNN is not available")


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_packed_linear_equals_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen).bfloat16()
    x = torch.randn(rows, 80, generator=gen).bfloat16()
    packed = PackedWeight(w)
    assert packed.shape == (96, 80)
    torch.testing.assert_close(packed.linear(x), torch.nn.functional.linear(x, w), rtol=0.01, atol=0.01)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prepacked_engine_generates_what_the_plain_one_does(tiny_model_dir, family: str) -> None:
    rng = random.Random(0)
    vocab = FAMILIES[family]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for prepack in (False, True):
        llm = LLM.from_hf(tiny_model_dir(family), dtype="bfloat16", num_kv_blocks=64, prepack_weights=prepack)
        if llm.engine.prepack_thread is not None:
            llm.engine.prepack_thread.join()
        packed = [type(layer.qkv).__name__ for layer in llm.engine.runner.model.weights.layers]
        assert set(packed) == {"PackedWeight" if prepack else "Tensor"}
        outs[prepack] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_serving_while_packing_gives_the_same_tokens(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    prompts = [[5, 6, 7, 8], list(range(10, 40))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16", num_kv_blocks=64, prepack_weights=False)
    racing = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16", num_kv_blocks=64)  # packs as it serves
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in racing.generate(prompts, params)] == expected
