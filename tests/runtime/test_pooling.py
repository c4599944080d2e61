"""Embeddings from the engine (runtime/engine/pooling.py): each prompt's final hidden states, pooled by its last
token or its mean, L2-normalized, equal to transformers' AutoModel for every family, in passes bounded by the
step's token budget; the borrowed KV blocks go back; what cannot be embedded is refused before anything runs."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModel

from tests.support.model_configs import FAMILIES
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.engine.pooling import PoolBusy, embed


def reference(model_dir, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1))
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2", "gemma3"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers(tiny_model_dir, family: str, pooling: str) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    vocab = FAMILIES[family]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 40, 90, 33)]
    # a budget of 64 tokens a pass: several passes, and the 90-token prompt alone in one
    llm = LLM.from_hf(tiny_model_dir(family), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    free = llm.engine.blocks.num_free_blocks
    ours = llm.embed(prompts, pooling=pooling)
    assert llm.engine.blocks.num_free_blocks == free  # the borrowed blocks went back
    for got, want in zip(ours, reference(tiny_model_dir(family), prompts, pooling), strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_unnormalized_embeddings_are_the_hidden_states(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=16)
    (raw,) = llm.embed([[5, 6, 7]], normalize=False)
    model = AutoModel.from_pretrained(tiny_model_dir("llama"), torch_dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([[5, 6, 7]])).last_hidden_state[0, -1]
    assert torch.allclose(raw, want, atol=1e-5) and abs(float(raw.norm()) - 1) > 1e-3


def test_a_pool_held_by_running_requests_is_busy_and_generation_goes_on(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=4, max_model_len=64)
    engine = llm.engine
    engine.add_request(list(range(3, 50)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # its prompt holds 3 of the 4 blocks
    with pytest.raises(PoolBusy, match="retry when running requests finish"):
        embed(engine, [list(range(3, 40))])
    while engine.has_unfinished():
        engine.step()
    assert len(embed(engine, [list(range(3, 40))])) == 1


@pytest.mark.parametrize(("prompts", "pooling", "message"), [
    ([], "last", "no prompts"),
    ([[5, 6]], "max", "pooling must be one of last, mean"),
    ([[5, 10**9]], "last", "outside the vocabulary"),
    ([list(range(3, 100))], "last", "more than the context of 64"),
])
def test_what_cannot_be_embedded_is_refused(tiny_model_dir, prompts: list[list[int]], pooling: str,  # type: ignore[no-untyped-def]
                                            message: str) -> None:
    llm = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        embed(llm.engine, prompts, pooling)
