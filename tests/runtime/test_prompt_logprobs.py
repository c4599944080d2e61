"""Prompt logprobs (echo with logprobs): each prompt token's logprob is what the model gave it when it was
generated, whatever the chunking and even when the prompt is cached from an earlier request."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest

from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.outputs import RequestOutput
from warmstart.runtime.sampling_params import SamplingParams

PROMPT = [5 + (j * 37) % 900 for j in range(19)]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    return tiny_model_dir("llama")


def finish(e: LLMEngine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    rid = e.add_request(prompt, params)
    while True:
        for out in e.step():
            if out.request_id == rid and out.finished:
                return out


def engine(model_dir: pathlib.Path, batched_tokens: int = 2048) -> LLMEngine:
    return LLMEngine.from_hf(model_dir, EngineOptions(dtype="float32", block_size=8, num_kv_blocks=64,
                                                      max_num_batched_tokens=batched_tokens, prepack_weights=False))


def test_prompt_logprobs_equal_the_generated_tokens_logprobs(llama_dir: pathlib.Path) -> None:
    e = engine(llama_dir)
    generated = finish(e, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True))
    assert generated.logprobs is not None
    ask = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, ignore_eos=True)
    for where in (e, engine(llama_dir, batched_tokens=8)):  # cached prompt; prefilled in chunks of 8
        echoed = finish(where, PROMPT + generated.token_ids, ask)
        lps = echoed.prompt_logprobs
        assert lps is not None and len(lps) == len(PROMPT) + 6 and lps[0] is None
        assert all(lp is not None and lp.token_id == t for lp, t in zip(lps[1:], PROMPT[1:] + generated.token_ids,
                                                                        strict=True))
        for lp, want in zip(lps[len(PROMPT):], generated.logprobs, strict=True):
            assert lp is not None
            assert lp.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert list(lp.top) == list(want.top) and len(lp.top) == 2
            assert lp.rank == 1  # greedy: each generated token was the most likely (vLLM's rank, 1-based)


def test_without_prompt_logprobs_the_output_has_none(llama_dir: pathlib.Path) -> None:
    out = finish(engine(llama_dir), PROMPT, SamplingParams(max_tokens=2))
    assert out.prompt_logprobs is None
