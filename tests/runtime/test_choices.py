"""n > 1: the prompt is computed once and the choices fork from it (shared full blocks, a copied partial last
block), each with its own seed stream: choice k draws exactly what a lone request seeded seed + k draws."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest

from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.outputs import RequestOutput
from warmstart.runtime.sampling_params import SamplingParams

PROMPT = [5 + (j * 37) % 900 for j in range(21)]  # 2 full blocks of 8 and a partial one


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Callable[[str], pathlib.Path]) -> pathlib.Path:
    return tiny_model_dir("llama")


def engine(model_dir: pathlib.Path, num_kv_blocks: int = 64) -> LLMEngine:
    return LLMEngine.from_hf(model_dir, EngineOptions(dtype="float32", block_size=8, num_kv_blocks=num_kv_blocks,
                                                      seed=0, prepack_weights=False))


def run(e: LLMEngine) -> dict[tuple[str, int], RequestOutput]:
    done = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                done[out.request_id, out.index] = out
    return done


def params(seed: int | None, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=12, ignore_eos=True)


def test_each_choice_equals_a_lone_request_seeded_seed_plus_index(llama_dir: pathlib.Path) -> None:
    lone = engine(llama_dir)
    for k in range(3):
        lone.add_request(PROMPT, params(40 + k), f"alone{k}")
    alone = run(lone)
    want = [alone[f"alone{k}", 0].token_ids for k in range(3)]

    e = engine(llama_dir)
    e.add_request(PROMPT, params(40, n=3), "r")
    got = run(e)
    assert [got["r", k].token_ids for k in range(3)] == want
    assert len({tuple(t) for t in want}) == 3  # the choices differ
    assert e.prompt_tokens == len(PROMPT)  # computed once, not three times
    assert e.blocks.prefix_queries == len(PROMPT)
    assert e.blocks.num_used_blocks == 0  # every choice gave its blocks back


def test_choices_share_the_prompts_full_blocks_and_copy_the_partial_one(llama_dir: pathlib.Path) -> None:
    e = engine(llama_dir)
    e.add_request(PROMPT, params(7, n=3), "r")
    e.step()  # the prompt, and each choice's first token
    seqs = [e.outputs.requests[rid][0] for rid in ("r", "r#1", "r#2")]
    tables = [s.block_table for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert all(e.blocks.ref_counts[b] == 3 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 3  # each its own copy of the partial block
    assert sorted(e.blocks.pending_copies) == sorted((tables[0][2], t[2]) for t in tables[1:])
    assert all(s.num_output_tokens == 1 for s in seqs)


def test_without_a_block_for_the_copy_a_choice_recomputes_and_draws_the_same(llama_dir: pathlib.Path) -> None:
    roomy = engine(llama_dir)
    roomy.add_request(PROMPT, params(3, n=2), "r")
    want = run(roomy)

    tight = engine(llama_dir, num_kv_blocks=3)  # the prompt's 3 blocks: none left for the copy
    tight.add_request(PROMPT, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=3, ignore_eos=True), "r")
    got = run(tight)
    assert [got["r", k].token_ids for k in range(2)] == [want["r", k].token_ids[:3] for k in range(2)]


def test_abort_ends_every_choice_forked_or_not(llama_dir: pathlib.Path) -> None:
    e = engine(llama_dir)
    e.add_request(PROMPT, params(1, n=3), "waiting")
    e.abort("waiting")  # choices 1 and 2 never forked
    e.add_request(PROMPT, params(1, n=3), "running")
    e.step()
    e.abort("running")
    assert not e.has_unfinished() and not e.outputs.requests
    assert e.blocks.num_used_blocks == 0


def test_unseeded_choices_differ(llama_dir: pathlib.Path) -> None:
    e = engine(llama_dir)
    e.add_request(PROMPT, params(None, n=3), "r")
    got = run(e)
    assert len({tuple(got["r", k].token_ids) for k in range(3)}) == 3


def test_choices_survive_preemption_with_the_same_tokens(llama_dir: pathlib.Path) -> None:
    seeded = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=20, ignore_eos=True)
    roomy = engine(llama_dir)
    roomy.add_request(PROMPT, seeded, "r")
    want = run(roomy)

    tight = engine(llama_dir, num_kv_blocks=8)  # 3 choices of 41 tokens need 3 * 6 blocks, less the shared 2
    tight.add_request(PROMPT, seeded, "r")
    got = run(tight)
    assert tight.scheduler.num_preemptions > 0
    assert [got["r", k].token_ids for k in range(3)] == [want["r", k].token_ids for k in range(3)]
