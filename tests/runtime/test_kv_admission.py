"""Admission against the KV pool: a request is refused at once when it could never be
scheduled, counting the blocks that snapshot prefixes and adapters pin for good; a pool sized from memory
gets the pinned blocks on top; a pool too small for them is refused saying what to change. Also the cap on
``stop_token_ids`` and its per-token check (item 8)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import warmstart.runtime.engine.kv_sizing as kv_sizing
from warmstart.runtime.engine.block_manager import block_hashes
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.kv_sizing import kv_blocks_for_memory
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.weights import ModelWeights, load_weights
from warmstart.runtime.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

ModelDir = Callable[[str], pathlib.Path]
Loaded = tuple[ModelConfig, ModelWeights]


@pytest.fixture(scope="module")
def models(tiny_model_dir: ModelDir) -> dict[str, Loaded]:
    """Config and float32 weights of the tiny llama and of mistral (a 24-token sliding window), loaded once."""
    out = {}
    for family in ("llama", "mistral"):
        config = ModelConfig.from_dir(tiny_model_dir(family))
        out[family] = (config, load_weights(tiny_model_dir(family), config, torch.float32))
    return out


def make_engine(model: Loaded, pinned_blocks: int = 0, **options: Any) -> LLMEngine:
    config, weights = model
    return LLMEngine.from_weights(config, weights, None, EngineOptions(dtype="float32", **options),
                                  pinned_blocks=pinned_blocks)


def pin_prefix(engine: LLMEngine, token_ids: list[int]) -> int:
    """Load ``token_ids`` as a snapshot prefix (zero KV: scheduling does not read it); returns blocks pinned."""
    c, bs = engine.config, engine.blocks.block_size
    hashes = block_hashes(token_ids, bs)
    kv = torch.zeros(c.num_layers, 2, c.num_kv_heads, len(hashes), bs, c.head_dim)
    engine.prefixes.load_prefix(token_ids, hashes, kv)
    return len(hashes)


def pin_adapter(engine: LLMEngine, name: str, num_tokens: int) -> int:
    c, bs = engine.config, engine.blocks.block_size
    blocks = -(-num_tokens // bs)
    engine.prefixes.load_adapter(name, "PROMPT_TUNING", num_tokens,
                        torch.zeros(c.num_layers, 2, c.num_kv_heads, blocks, bs, c.head_dim))
    return blocks


def run_to_end(engine: LLMEngine, max_steps: int) -> int:
    steps = 0
    while engine.has_unfinished():
        assert steps < max_steps, f"requests still unfinished after {max_steps} steps: {engine.stats()}"
        engine.step()
        steps += 1
    return steps


GREEDY_FULL = {"temperature": 0.0, "ignore_eos": True}


# -- the pool's size ---------------------------------------------------------------------------------------


def test_default_pool_puts_the_pinned_blocks_on_top(models: dict[str, Loaded]) -> None:
    """The issue's setting: 512-token context, --max-num-seqs 2, prefixes pinning 33 blocks of 16."""
    config = models["llama"][0]
    options = EngineOptions(dtype="float32", max_num_seqs=2)
    assert kv_blocks_for_memory(config, options, 512) == 2 * 32
    assert kv_blocks_for_memory(config, options, 512, pinned_blocks=33) == 2 * 32 + 33


def test_pool_sized_from_memory_serves_a_full_context_beside_pinned_prefixes(models: dict[str, Loaded]) -> None:
    # 40 blocks of 4 are pinned, more than one 128-token sequence needs (32): the old pool of 2 * 32 left 24.
    prefix = list(range(3, 163))
    engine = make_engine(models["llama"], pinned_blocks=40, block_size=4, max_model_len=128, max_num_seqs=2)
    assert pin_prefix(engine, prefix) == 40
    assert engine.blocks.num_blocks == 2 * 32 + 40 and engine.blocks.num_usable_blocks == 64
    first = engine.add_request([5], SamplingParams(max_tokens=127, **GREEDY_FULL))
    second = engine.add_request([6, 7], SamplingParams(max_tokens=20, **GREEDY_FULL))
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(finished[first].token_ids) == 127 and len(finished[second].token_ids) == 20


def test_pool_too_small_for_the_pinned_blocks_says_which_value_works(
    models: dict[str, Loaded], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"pin 33 KV blocks.*--num-kv-blocks\) to at least 65 \(33 pinned plus 32"):
        make_engine(models["llama"], pinned_blocks=33, num_kv_blocks=33, max_model_len=512)
    monkeypatch.setattr(kv_sizing, "available_memory", lambda: 1 << 16)  # room for a handful of blocks
    with pytest.raises(ValueError, match=r"from available memory.*kv_cache_memory_fraction.*--num-kv-blocks\) to 65"):
        make_engine(models["llama"], pinned_blocks=33, max_model_len=512)


def test_loading_more_pinned_blocks_than_are_free_says_which_value_works(models: dict[str, Loaded]) -> None:
    """Without being told the pinned count up front (LLMEngine used directly), loading still fails clearly."""
    engine = make_engine(models["llama"], num_kv_blocks=10, block_size=4, max_model_len=64)
    pin_prefix(engine, list(range(3, 27)))  # 6 blocks
    with pytest.raises(ValueError, match=r"adapter 'a' needs 5 KV blocks pinned, but only 4 .*at least 27"):
        pin_adapter(engine, "a", 20)


# -- admission ---------------------------------------------------------------------------------------------


def test_request_that_can_never_be_free_enough_is_refused_with_the_limit(models: dict[str, Loaded]) -> None:
    engine = make_engine(models["llama"], num_kv_blocks=14, block_size=4, max_model_len=64, max_num_seqs=2)
    prefix = list(range(3, 35))
    pin_prefix(engine, prefix)  # 8 of 14 blocks pinned: 6 can ever be free
    message = (r"prompt is 2 tokens and max_tokens 25, but at most 22 tokens can follow this prompt in the KV pool: 6 "
               r"of its 14 blocks of 4 tokens can ever be free for one request, 8 of them pinned.*lower max_tokens to "
               r"at most 22, or raise num_kv_blocks \(serve --num-kv-blocks\)")
    with pytest.raises(ValueError, match=message):
        engine.add_request([5, 6], SamplingParams(max_tokens=25))  # 27 tokens: 7 blocks
    assert not engine.has_unfinished()
    engine.add_request([5, 6], SamplingParams(max_tokens=22, **GREEDY_FULL))
    # A prompt that starts with the pinned prefix shares its blocks: only what follows needs free ones.
    engine.add_request(prefix + [7], SamplingParams(max_tokens=23, **GREEDY_FULL))
    with pytest.raises(ValueError, match="at most 23"):
        engine.add_request(prefix + [7], SamplingParams(max_tokens=24))
    run_to_end(engine, 500)
    assert engine.blocks.num_free_blocks == 6


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    block_size = draw(st.sampled_from([2, 4, 8]), label="block_size")
    max_model_len = draw(st.integers(8, 40), label="max_model_len")
    prefixes = draw(st.lists(st.lists(st.integers(3, 700), min_size=block_size, max_size=3 * block_size),
                             max_size=2), label="prefixes")
    adapter_tokens = draw(st.none() | st.integers(1, 2 * block_size), label="adapter_tokens")
    pinned = sum(len(p) // block_size for p in prefixes) + (-(-adapter_tokens // block_size) if adapter_tokens else 0)
    per_sequence = -(-max_model_len // block_size)
    # Mostly pools that leave about one full-length sequence free: tight enough to refuse and to preempt.
    tight = st.integers(pinned + 1, pinned + per_sequence + 2)
    pool = draw(st.none() | st.integers(1, pinned + 2 * per_sequence) | tight, label="num_kv_blocks")
    requests = draw(st.lists(st.tuples(
        st.integers(-1, len(prefixes) - 1),  # which prefix the prompt starts with; -1: none
        st.lists(st.integers(3, 700), min_size=1, max_size=max_model_len),  # the rest of the prompt
        st.integers(1, max_model_len),  # max_tokens
        st.booleans(),  # behind the adapter
        st.integers(0, 2),  # steps taken before the next request arrives
    ), min_size=1, max_size=6), label="requests")
    return {
        "family": draw(st.sampled_from(["llama", "mistral"]), label="family"),
        "options": {"block_size": block_size, "max_model_len": max_model_len, "num_kv_blocks": pool,
                    "max_num_seqs": draw(st.integers(1, 4), label="max_num_seqs"),
                    "max_num_batched_tokens": draw(st.integers(2, 32), label="max_num_batched_tokens"),
                    "speculative": draw(st.sampled_from([None, "ngram"]), label="speculative")},
        "prefixes": prefixes, "adapter_tokens": adapter_tokens, "pinned": pinned, "requests": requests,
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_every_request_is_refused_at_submit_or_finishes(models: dict[str, Loaded], scenario: dict[str, Any]) -> None:
    """Random pools, pinned prefixes and adapters, max_num_seqs, budgets and request sizes: the engine either
    refuses to start (saying which pool would do), refuses a request when it is submitted, or finishes every
    request it accepted within a bounded number of steps. No request waits forever."""
    options, pinned = scenario["options"], scenario["pinned"]
    try:
        engine = make_engine(models[scenario["family"]], pinned_blocks=pinned, **options)
    except ValueError as e:
        assert options["num_kv_blocks"] is not None and options["num_kv_blocks"] <= pinned
        event("the pool is refused")
        assert f"to at least {pinned + -(-engine_max_len(models, scenario) // options['block_size'])}" in str(e)
        return
    for prefix in scenario["prefixes"]:
        pin_prefix(engine, prefix)
    adapter_tokens = scenario["adapter_tokens"]
    if adapter_tokens:
        pin_adapter(engine, "a", adapter_tokens)
    assert engine.blocks.num_usable_blocks == engine.blocks.num_blocks - pinned >= 1
    bs, max_len, usable = options["block_size"], engine.max_model_len, engine.blocks.num_usable_blocks
    accepted, work, steps = [], 0, 0
    for which, tail, max_tokens, behind_adapter, pause in scenario["requests"]:
        prompt = (scenario["prefixes"][which] if which >= 0 else []) + tail
        adapter = "a" if behind_adapter and adapter_tokens else None
        params = SamplingParams(max_tokens=max_tokens, **GREEDY_FULL)
        try:
            accepted.append(engine.add_request(prompt, params, adapter=adapter))
            event("a request accepted")
            work += len(prompt) + max_tokens + (adapter_tokens or 0)
        except ValueError as e:
            total = len(prompt) + (adapter_tokens if adapter else 0)
            if total >= max_len:
                assert "context" in str(e)
            else:  # refused for the pool: only a request whose whole length could not fit beside the pinned
                assert "num_kv_blocks" in str(e)
                event("a request refused for the pool")
                assert -(-min(total + max_tokens, max_len) // bs) > usable
        for _ in range(pause):
            engine.step()
            steps += 1
    # Each step computes at least one token unless it preempts; preemption recomputes at most what was done.
    steps += run_to_end(engine, max_steps=20 * work + 100)
    event(f"{'some' if engine.stats().num_preemptions else 'no'} preemptions")
    event(f"{'some' if pinned else 'no'} pinned blocks")
    assert engine.blocks.num_free_blocks == usable  # everything given back; only the pinned blocks held


def engine_max_len(models: dict[str, Loaded], scenario: dict[str, Any]) -> int:
    config = models[scenario["family"]][0]
    return min(scenario["options"]["max_model_len"], config.max_position_embeddings)


# -- stop_token_ids ----------------------------------------------------------------------------------------


def test_stop_token_ids_are_capped_at_a_documented_limit() -> None:
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(ValueError, match=rf"stop_token_ids holds {MAX_STOP_TOKEN_IDS + 1} ids; at most "
                                         rf"{MAX_STOP_TOKEN_IDS} are supported"):
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(ValueError, match="must be a list of token ids"):
        SamplingParams(stop_token_ids=7)  # type: ignore[arg-type]


class CountingList(list[int]):
    """A list that counts how often it is searched or walked."""

    scans = 0

    def __contains__(self, item: object) -> bool:
        CountingList.scans += 1
        return super().__contains__(item)

    def __iter__(self) -> Any:
        CountingList.scans += 1
        return super().__iter__()


def test_stop_token_ids_are_not_scanned_per_generated_token(models: dict[str, Loaded]) -> None:
    """The request's list is read at submit, then each generated token is one set lookup; the stop still
    works, found at the end of a long list."""
    engine = make_engine(models["llama"], num_kv_blocks=32)
    free = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, **GREEDY_FULL))
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == free]
    tokens = outputs[-1].token_ids
    k = max(i for i, t in enumerate(tokens) if t not in tokens[:i])  # the last token seen for the first time
    ids = CountingList([t for t in range(engine.config.vocab_size) if t not in tokens[: k + 1]] + [tokens[k]])
    CountingList.scans = 0
    stopped = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, stop_token_ids=ids, **GREEDY_FULL))
    at_submit = CountingList.scans
    last = None
    while engine.has_unfinished():
        last = next((o for o in engine.step() if o.request_id == stopped), last)
    assert last is not None and last.finish_reason == "stop" and last.token_ids == tokens[: k + 1]
    assert CountingList.scans == at_submit, f"{CountingList.scans - at_submit} scans over {k + 1} generated tokens"
