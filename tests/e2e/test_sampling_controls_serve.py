"""Sampling controls and n > 1 through the official `openai` client against a real `warmstart serve` process on
the tiny random model: logit_bias forces and bans tokens, the penalties and min_tokens visibly change what is
generated, bad_words and echo; n choices reproducible with a seed, streamed with their indexes, the prompt
computed once, best_of keeping the choice of highest cumulative logprob; bad values a 400 naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.serving import KEY, ServerProcess, TinySnapshot, build_tiny_snapshot
from warmstart.runtime.tokenizer import Tokenizer

PROMPT = "The quick brown fox jumps over"
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("llama")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def snap(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:
    return build_tiny_snapshot(model_dir, tmp_path_factory.mktemp("controls"))


@pytest.fixture(scope="module")
def server(snap: TinySnapshot) -> Iterator[ServerProcess]:
    s = ServerProcess(snap, "--num-kv-blocks", "256", "--max-model-len", "256")
    s.wait_for("ready")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


def word_tokens(tok: Tokenizer) -> list[int]:
    """Ids of whole words (letters, the one token of their text): the text of a run of them is exact."""
    return [t for t in range(300, 1000)
            if tok.decode([t]).isalpha() and tok.encode(tok.decode([t]), add_special_tokens=False) == [t]]


@pytest.fixture(scope="module")
def words(tok: Tokenizer) -> list[int]:
    found = word_tokens(tok)
    assert len(found) >= 3
    return found[:3]


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    args: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, **kw}
    extra = {k: args.pop(k) for k in ("min_tokens", "repetition_penalty", "bad_words", "stop_token_ids",
                                      "ignore_eos", "prompt_logprobs", "skip_special_tokens") if k in args}
    return client.completions.create(**args, extra_body=extra or None)


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(client: openai.OpenAI, tok: Tokenizer,
                                                                   words: list[int]) -> None:
    T, U = words[:2]
    # The tiny model's raw logits lie within about 12 of each other: gaps of 30 decide.
    forced = complete(client, logit_bias={str(T): 100, str(U): 70})
    assert forced.choices[0].text == tok.decode([T] * 6)
    banned = complete(client, logit_bias={str(T): -100, str(U): 70})
    assert banned.choices[0].text == tok.decode([U] * 6)


def test_frequency_and_presence_penalties_break_a_repetition(client: openai.OpenAI, tok: Tokenizer,
                                                             words: list[int]) -> None:
    T, U = words[:2]
    bias = {str(T): 100, str(U): 80}  # 20 apart, more than the raw logits' spread (about 12)
    assert complete(client, logit_bias=bias, max_tokens=24).choices[0].text == tok.decode([T] * 24)
    for field in ("frequency_penalty", "presence_penalty"):
        text = complete(client, logit_bias=bias, max_tokens=24, **{field: 2.0}).choices[0].text
        if field == "frequency_penalty":  # T's logit falls by 2 a use: U overtakes it within 16 uses
            assert tok.decode([U]) in text and text.startswith(tok.decode([T]))
        else:  # one use costs T 2 for good: still far above U
            assert text == tok.decode([T] * 24)


def test_repetition_penalty_covers_the_prompt(client: openai.OpenAI, tok: Tokenizer, words: list[int]) -> None:
    T, U = words[:2]
    prompt = [5, 9, T, 11]  # T in the prompt: its biased logit (about 100) is halved, below U's (about 70)
    bias = {str(T): 100, str(U): 70}
    assert complete(client, prompt=prompt, logit_bias=bias).choices[0].text == tok.decode([T] * 6)
    text = complete(client, prompt=prompt, logit_bias=bias, repetition_penalty=2.0).choices[0].text
    assert text == tok.decode([U] + [T] * 5)  # once U is in the output both are halved, and T leads again


@pytest.mark.parametrize("end", ["stop_token_ids", "eos"])
def test_min_tokens_holds_back_an_early_end(client: openai.OpenAI, end: str, words: list[int]) -> None:
    T = words[0]
    kw: dict[str, Any] = {"stop_token_ids": [T], "logit_bias": {str(T): 100}} if end == "stop_token_ids" else {
        "logit_bias": {str(EOS): 100}}
    early = complete(client, max_tokens=10, **kw)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    held = complete(client, max_tokens=10, min_tokens=4, **kw)
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"


def test_bad_words_bans_a_forced_word(client: openai.OpenAI, tok: Tokenizer, words: list[int]) -> None:
    word, U = words[2], words[1]
    text = tok.decode([word])
    assert tok.encode(" " + text, add_special_tokens=False)[0] != U  # vLLM bans the spaced form too
    bias = {str(word): 100, str(U): 70}
    assert complete(client, logit_bias=bias).choices[0].text == tok.decode([word] * 6)
    assert complete(client, logit_bias=bias, bad_words=[text]).choices[0].text == tok.decode([U] * 6)


def test_echo_prepends_the_prompt_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = complete(client, echo=True).choices[0].text
    plain = complete(client).choices[0].text
    assert whole == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in complete(client, echo=True, stream=True))
    assert streamed == whole


def test_echo_with_logprobs_gives_the_prompts_logprobs_first(client: openai.OpenAI, tok: Tokenizer) -> None:
    prompt = [5, 9, 300, 301, 302]
    plain = complete(client, prompt=prompt, max_tokens=4, logprobs=2)
    echoed = complete(client, prompt=prompt, max_tokens=4, logprobs=2, echo=True)
    lp, own = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert echoed.choices[0].text == tok.decode(prompt) + plain.choices[0].text
    assert lp.tokens[:5] == [tok.decode([t]) for t in prompt] and lp.tokens[5:] == own.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:5])
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.token_logprobs[5:] == pytest.approx(own.token_logprobs, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(complete(client, prompt=prompt, max_tokens=4, logprobs=2, echo=True, stream=True))
    assert [t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])] == lp.tokens


def test_prompt_logprobs_in_vllms_shape_whole_and_streamed(client: openai.OpenAI, tok: Tokenizer) -> None:
    prompt = [5, 9, 300, 301, 302]
    echoed = complete(client, prompt=prompt, max_tokens=2, logprobs=3, echo=True).choices[0].logprobs
    whole = complete(client, prompt=prompt, max_tokens=2, prompt_logprobs=2).model_dump()["choices"][0]
    assert whole["logprobs"] is None  # prompt_logprobs alone asks nothing of the generated tokens
    entries = whole["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for k, entry in enumerate(entries[1:], start=1):
        chosen = entry[str(prompt[k])]
        assert chosen["logprob"] == pytest.approx(echoed.token_logprobs[k], abs=1e-4)
        assert chosen["decoded_token"] == tok.decode([prompt[k]])
        top = sorted((v for t, v in entry.items() if v["rank"] <= 2), key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == [1, 2]  # the top 2, beside the prompt's token whatever its rank
        assert [v["logprob"] for v in top] == pytest.approx(sorted(echoed.top_logprobs[k].values(), reverse=True)[:2],
                                                            abs=1e-4)
        assert chosen["rank"] >= 1 and (chosen["rank"] <= 2) == (len(entry) == 2)
    first, *rest = [c.model_dump()["choices"][0] for c in complete(client, prompt=prompt, max_tokens=2,
                                                                    prompt_logprobs=2, stream=True)]
    assert first["prompt_logprobs"] == entries and all("prompt_logprobs" not in c for c in rest)
    both = complete(client, prompt=prompt, max_tokens=2, logprobs=3, echo=True, prompt_logprobs=1)
    assert [set(top) for top in both.choices[0].logprobs.top_logprobs[1:5]] == [
        set(top) for top in echoed.top_logprobs[1:5]] and all(len(top) == 3 for top in echoed.top_logprobs[1:5])
    assert all(len(e) <= 2 for e in both.model_dump()["choices"][0]["prompt_logprobs"][1:])  # each its own top-n
    none = complete(client, prompt=prompt, max_tokens=2, prompt_logprobs=0).model_dump()["choices"][0]
    assert [e and list(e) for e in none["prompt_logprobs"]] == [None, *([str(t)] for t in prompt[1:])]


def test_skip_special_tokens_false_keeps_a_forced_special_token(client: openai.OpenAI, tok: Tokenizer) -> None:
    bos = tok.decode([1], skip_special_tokens=False)
    forced = {"logit_bias": {"1": 100}, "max_tokens": 3}
    kept = complete(client, **forced, skip_special_tokens=False).choices[0].text
    assert kept == bos * 3 and complete(client, **forced).choices[0].text == ""
    chat = [{"role": "user", "content": "hi"}]
    replies = [client.chat.completions.create(model="tiny", messages=chat, temperature=0,  # type: ignore[arg-type]
                                              extra_body={"skip_special_tokens": skip}, **forced)
               for skip in (False, True)]  # fmt: skip
    assert [r.choices[0].message.content for r in replies] == [bos * 3, ""]


def test_vllm_fields_with_bad_values_or_out_of_place_are_a_400(client: openai.OpenAI) -> None:
    for kw, param in (({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
                      ({"skip_special_tokens": "no"}, "skip_special_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            complete(client, **kw)
        assert e.value.param == param, e.value.body
    with pytest.raises(openai.BadRequestError, match="completions only") as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"prompt_logprobs": 1})
    assert e.value.param == "prompt_logprobs"


def prompt_tokens_computed(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    match = re.search(r"^warmstart:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert match, text[:2000]
    return float(match.group(1))


def test_n_choices_are_seeded_distinct_and_the_prompt_is_computed_once(client: openai.OpenAI,
                                                                      server: ServerProcess) -> None:
    prompt = [7 + (i * 13) % 900 for i in range(37)]  # not in the prefix cache: all of it computed
    before = prompt_tokens_computed(server)
    first = complete(client, prompt=prompt, n=3, seed=11, temperature=1.0, max_tokens=8)
    assert prompt_tokens_computed(server) - before == len(prompt)
    again = complete(client, prompt=prompt, n=3, seed=11, temperature=1.0, max_tokens=8)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in again.choices] == texts
    assert len(set(texts)) == 3
    assert first.usage.prompt_tokens == len(prompt)
    assert first.usage.completion_tokens == 24


def test_streamed_choices_carry_their_index(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                           seed=5, max_tokens=6)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                                 seed=5, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {i: "" for i in range(3)}
    roles = []
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.index)
    assert sorted(roles) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 18


def test_best_of_keeps_the_choice_of_highest_cumulative_logprob(client: openai.OpenAI) -> None:
    all_three = complete(client, n=3, seed=21, temperature=1.0, max_tokens=8, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in all_three.choices]
    best = complete(client, n=1, best_of=3, seed=21, temperature=1.0, max_tokens=8)
    assert [c.text for c in best.choices] == [all_three.choices[sums.index(max(sums))].text]
    assert best.choices[0].logprobs is None  # ranked by logprobs, shown only when asked
    assert best.usage.completion_tokens == 24  # every generated choice counts


@pytest.mark.parametrize(("kw", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"1000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_tokens": 7}, "min_tokens"),
    ({"bad_words": [""]}, "bad_words"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"n": 0}, "n"),
])  # fmt: skip
def test_bad_values_are_a_400_naming_the_field(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, **kw)
    assert e.value.param == param, e.value.body
