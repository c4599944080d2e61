"""When generation stops (stop token ids, EOS, max_tokens, context, stop strings) and the text it returns,
through LLM / LLMEngine on a tiny model and through the Detokenizer directly."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.support.model_configs import FAMILIES
from warmstart.runtime import LLM, LLMEngine, SamplingParams
from warmstart.runtime.tokenizer import Detokenizer, Tokenizer

ModelDir = Callable[[str], pathlib.Path]
PROMPT = "The quick brown fox"
N = 24


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: ModelDir) -> pathlib.Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(llama_dir: pathlib.Path) -> LLM:
    return LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def tokenizer(llama_dir: pathlib.Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def greedy(**kw: object) -> SamplingParams:
    base: dict[str, object] = {"temperature": 0.0, "max_tokens": N, "ignore_eos": True}
    return SamplingParams(**{**base, **kw})  # type: ignore[arg-type]


@dataclass
class Run:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    pieces: list[str]  # new_text of each step's output
    texts: list[str]  # cumulative text after each output


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> Run:
    """Run one request alone, keeping every streamed output."""
    rid = engine.add_request(prompt, params)
    pieces, texts, tokens = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            pieces.append(out.new_text)
            texts.append(out.text)
            tokens += out.new_token_ids
            assert out.token_ids == tokens
            if out.finished:
                assert "".join(pieces) == out.text
                return Run(out.token_ids, out.text, out.finish_reason, pieces, texts)
    raise AssertionError("the request never finished")


@pytest.fixture(scope="module")
def reference(llm: LLM) -> Run:
    """The greedy continuation of PROMPT with nothing stopping it early."""
    run = stream(llm.engine, PROMPT, greedy())
    assert len(run.token_ids) == N and run.finish_reason == "length"
    return run


# -- stop token ids, EOS, length -------------------------------------------------------------------------------


def first_new_token_index(tokens: list[int], start: int = 3) -> int:
    """An index whose token did not occur before it, so stopping on that token stops exactly there."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_token_id_stops_with_reason_stop(llm: LLM, reference: Run) -> None:
    k = first_new_token_index(reference.token_ids)
    stop_id = reference.token_ids[k]
    for ignore_eos in (True, False):  # stop_token_ids apply either way
        run = stream(llm.engine, PROMPT, greedy(stop_token_ids=[stop_id], ignore_eos=ignore_eos))
        assert run.token_ids == reference.token_ids[: k + 1]
        assert run.finish_reason == "stop"
        assert run.text.startswith(reference.texts[k - 1])
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_eos_from_the_config_stops_only_without_ignore_eos(
    llama_dir: pathlib.Path, tmp_path: pathlib.Path, llm: LLM, reference: Run
) -> None:
    assert llm.engine.eos_token_ids == {FAMILIES["llama"]["eos_token_id"]}
    k = first_new_token_index(reference.token_ids)
    eos = reference.token_ids[k]
    for config_value in (eos, [FAMILIES["llama"]["eos_token_id"], eos]):
        model = tmp_path / f"eos-{isinstance(config_value, list)}"
        shutil.copytree(llama_dir, model)
        config = json.loads((model / "config.json").read_text())
        config["eos_token_id"] = config_value
        (model / "config.json").write_text(json.dumps(config))
        eos_llm = LLM.from_hf(model, dtype="float32", num_kv_blocks=64)
        assert eos in eos_llm.engine.eos_token_ids
        stopped = stream(eos_llm.engine, PROMPT, greedy(ignore_eos=False))
        assert stopped.token_ids == reference.token_ids[: k + 1] and stopped.finish_reason == "stop"
        ignored = stream(eos_llm.engine, PROMPT, greedy(ignore_eos=True))
        assert ignored.token_ids == reference.token_ids and ignored.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_gives_length(llm: LLM, reference: Run, max_tokens: int) -> None:
    run = stream(llm.engine, PROMPT, greedy(max_tokens=max_tokens))
    assert run.token_ids == reference.token_ids[:max_tokens]
    assert run.finish_reason == "length"
    assert run.text == reference.texts[max_tokens - 1]


def test_full_context_gives_length(llama_dir: pathlib.Path) -> None:
    llm = LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=40)
    out = llm.generate([list(range(5, 35))], greedy(max_tokens=20))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


# -- stop strings through the engine ------------------------------------------------------------------------------


def straddling_stop(reference: Run) -> tuple[str, int, int]:
    """A stop string of plain letters spanning a token boundary, first found there.

    Returns (stop, where it starts in the text, how many tokens it takes to complete it).
    """
    pieces = reference.pieces
    for k in range(3, len(pieces)):
        left, right = pieces[k - 1], pieces[k]
        if len(left) >= 2 and len(right) >= 2 and (left[-2:] + right[:2]).replace(" ", "").isalpha():
            stop = left[-2:] + right[:2]
            at = len(reference.texts[k - 1]) - 2
            if reference.text.find(stop) == at and reference.texts[k - 1] == reference.text[: at + 2]:
                return stop, at, k + 1
    raise AssertionError(f"no usable stop string in {reference.text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text_and_finishes_early(llm: LLM, reference: Run, include: bool) -> None:
    stop, at, num_tokens = straddling_stop(reference)
    run = stream(llm.engine, PROMPT, greedy(stop=[stop], include_stop_str_in_output=include))
    assert run.finish_reason == "stop"
    assert run.token_ids == reference.token_ids[:num_tokens] and num_tokens < N
    assert run.text == reference.text[: at + len(stop) if include else at]
    for text in run.texts:  # never streamed past what is finally kept
        assert run.text.startswith(text)


def test_earliest_stop_string_wins_whatever_the_order(llm: LLM, reference: Run) -> None:
    stop, at, num_tokens = straddling_stop(reference)
    text = reference.text
    later = next(  # a string that first occurs after the straddling one
        text[i : i + 4] for i in range(at + len(stop), len(text) - 4) if text.find(text[i : i + 4]) == i
    )
    run = stream(llm.engine, PROMPT, greedy(stop=[later, stop]))
    assert run.text == reference.text[:at] and run.token_ids == reference.token_ids[:num_tokens]


def test_held_back_text_is_flushed_when_finishing_for_another_reason(llm: LLM, reference: Run) -> None:
    never = "\x00never appears\x00"
    run = stream(llm.engine, PROMPT, greedy(stop=[never]))
    assert run.finish_reason == "length" and run.text == reference.text
    assert any(len(t) < len(ref) for t, ref in zip(run.texts, reference.texts, strict=True))  # it was held back
    k = first_new_token_index(reference.token_ids)
    run = stream(llm.engine, PROMPT, greedy(stop=[never], stop_token_ids=[reference.token_ids[k]]))
    assert run.finish_reason == "stop" and run.text == reference.texts[k]


def test_stop_string_in_the_prompt_does_not_stop(llm: LLM, reference: Run) -> None:
    run = stream(llm.engine, PROMPT, greedy(stop=["quick brown"]))
    assert run.finish_reason == "length" and run.token_ids == reference.token_ids


# -- the Detokenizer directly -------------------------------------------------------------------------------------

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "café naïve — 日本語 🙂 ok",
    "def add(a, b):\n    return a + b\n",
    "Hello<|im_end|> there",
]


def feed(detok: Detokenizer, ids: list[int]) -> tuple[list[str], bool]:
    deltas = []
    for i in ids:
        delta = detok.add(i)
        deltas.append(delta.text)
        if delta.stopped:
            return deltas, True
    return deltas, False


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = Detokenizer(tokenizer, [])
    deltas, stopped = feed(detok, ids)
    assert not stopped
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # partial UTF-8 is held back, not emitted broken


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    detok = Detokenizer(tokenizer, [])
    assert detok.add(2).text == "" and detok.text == ""


def test_special_tokens_kept_when_asked_but_not_the_ones_that_end_the_request(tokenizer: Tokenizer) -> None:
    words = tokenizer.encode("Hello world", add_special_tokens=False)
    detok = Detokenizer(tokenizer, [], skip_special_tokens=False, end_ids={2})
    deltas, _ = feed(detok, [1, *words, 2])  # EOS (2) ends the request: its text is not the reply's
    text = "".join(deltas) + detok.flush()
    assert text == tokenizer.decode([1, *words], skip_special_tokens=False)
    assert text.startswith(tokenizer.hf.id_to_token(1)) and tokenizer.hf.id_to_token(2) not in text


def test_engine_keeps_special_tokens_for_requests_that_ask(llm: LLM) -> None:
    """A logit bias makes the reply a special token (1); kept in the text only without skipping."""
    prompt = llm.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    kept, skipped = (llm.generate([prompt], greedy(max_tokens=4, skip_special_tokens=skip, logit_bias={1: 100.0}))[0]
                     for skip in (False, True))
    assert kept.token_ids == skipped.token_ids and 1 in kept.token_ids
    assert kept.text == llm.tokenizer.decode(kept.token_ids, skip_special_tokens=False)  # type: ignore[union-attr]
    assert skipped.text == llm.tokenizer.decode(kept.token_ids)  # type: ignore[union-attr]


def test_ids_the_tokenizer_lacks_decode_to_nothing_and_do_not_break_the_stream(tokenizer: Tokenizer) -> None:
    a, b = tokenizer.encode("Hello world"), tokenizer.encode(" and more")
    detok = Detokenizer(tokenizer, [])
    deltas, _ = feed(detok, [*a, tokenizer.vocab_size + 7, *b])
    assert "".join(deltas) + detok.flush() == "Hello world and more"


def stop_split_case(tokenizer: Tokenizer) -> tuple[list[int], str]:
    text = "The quick brown fox jumps over the lazy dog."
    stop = "ick bro"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    assert sum(1 for p in pieces if any(c in p for c in "ickbro")) > 2  # really spread over tokens
    return ids, stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens_is_held_back_never_partly_emitted(
    tokenizer: Tokenizer, include: bool
) -> None:
    ids, stop = stop_split_case(tokenizer)
    detok = Detokenizer(tokenizer, [stop], include_stop=include)
    emitted = ""
    for n, i in enumerate(ids, 1):
        delta = detok.add(i)
        emitted += delta.text
        so_far = tokenizer.decode(ids[:n])
        if stop in so_far:
            assert delta.stopped
            break
        assert not delta.stopped
        assert "The qu".startswith(emitted), f"emitted {emitted!r} before the stop string was complete"
    else:
        raise AssertionError("the stop string was never found")
    assert emitted == ("The quick bro" if include else "The qu")
    assert detok.flush() == ""


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox jumps")
    detok = Detokenizer(tokenizer, ["fox", "quick", "brown"])
    deltas, stopped = feed(detok, ids)
    assert stopped and "".join(deltas) == "The "
    # Both complete on the same token ("ck"); the one that starts first in the text wins.
    detok = Detokenizer(tokenizer, ["ck", "uick"])
    deltas, stopped = feed(detok, ids)
    assert stopped and "".join(deltas) == "The q"


def test_stop_string_at_the_very_start(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The quick")
    detok = Detokenizer(tokenizer, ["The"])
    deltas, stopped = feed(detok, ids)
    assert stopped and deltas == [""]


def test_stop_string_that_never_appears_holds_back_at_most_its_length_minus_one(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    detok = Detokenizer(tokenizer, ["zzzz"])
    emitted = ""
    for n, i in enumerate(ids, 1):
        delta = detok.add(i)
        assert not delta.stopped
        emitted += delta.text
        so_far = tokenizer.decode(ids[:n])
        assert so_far.startswith(emitted) and len(emitted) >= len(so_far) - 3
    assert emitted + detok.flush() == text
