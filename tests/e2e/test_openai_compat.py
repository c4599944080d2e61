"""What clients send beyond the sampling fields, through the official `openai` client against real `warmstart
serve` processes: fields the server ignores (counted in /metrics), fields it refuses, the model's own
generation_config.json defaults stored in the snapshot, chat_template_kwargs, SentencePiece detokenization and
--reasoning-parser."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.sentencepiece import metaspace_model_dir
from tests.support.serving import AUTH, KEY, REF, ServerProcess, TinySnapshot, build_tiny_snapshot
from tests.support.thinking_model import REPLY_TOKENS, ThinkingModel, thinking_model_dir
from warmstart.runtime import LLM, SamplingParams

PROMPT = "Once upon a time"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


@pytest.fixture(scope="module")
def greedy_ids(tiny_model_dir) -> list[int]:  # type: ignore[no-untyped-def]
    """The tiny llama's greedy continuation of PROMPT, computed in-process (the engine matches transformers)."""
    llm = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=64)
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, greedy_ids: list[int], tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    """The tiny llama with a generation_config.json as real models ship it: one more EOS id (the 4th token of
    PROMPT's greedy continuation, as Llama 3 adds <|eot_id|>) and recommended sampling that is greedy in effect
    (top_k 1) though its temperature is not 0; and Qwen3's chat template."""
    out = tmp_path_factory.mktemp("gencfg") / "model"
    shutil.copytree(tiny_model_dir("llama"), out)
    config = json.loads((out / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    assert greedy_ids[3] not in greedy_ids[:3] and greedy_ids[3] != eos  # the 4th token is the first stop
    config.update(eos_token_id=[eos, greedy_ids[3]], do_sample=True, temperature=0.7, top_k=1, top_p=0.9)
    (out / "generation_config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = (FIXTURES / "qwen3.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out


@pytest.fixture(scope="module")
def snap(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:
    return build_tiny_snapshot(model_dir, tmp_path_factory.mktemp("compat"))


@pytest.fixture(scope="module")
def server(snap: TinySnapshot) -> Iterator[ServerProcess]:
    s = ServerProcess(snap, "--num-kv-blocks", "256", "--max-model-len", "512")
    s.wait_for("ready")
    yield s
    assert s.stop() == 0


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def ignored_count(server: ServerProcess, field: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    prefix = f'warmstart:request_ignored_fields_total{{field="{field}",model_name="{REF}"}}'
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


# -- item 1: unknown fields are ignored and counted; known ones that change the output are refused -------------


def test_fields_the_sdk_and_frameworks_add_are_accepted_and_counted(client: openai.OpenAI,
                                                                    server: ServerProcess) -> None:
    before = ignored_count(server, "prompt_cache_key")
    r = client.chat.completions.create(
        model=REF, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        reasoning_effort="low", prompt_cache_key="user-42", safety_identifier="hash-1",
        extra_body={"some_field_from_next_year": {"x": 1}}, stream_options=None)
    plain = client.chat.completions.create(model=REF, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content  # ignored: no effect
    assert ignored_count(server, "prompt_cache_key") == before + 1
    assert ignored_count(server, "some_field_from_next_year") >= 1
    completion = client.completions.create(model=REF, prompt=PROMPT, max_tokens=2,
                                           extra_body={"prompt_cache_key": "k", "priority": 3})
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert ignored_count(server, "prompt_cache_key") == before + 2


def test_unknown_stream_options_are_ignored(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=REF, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))  # type: ignore[typeddict-unknown-key]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": "hot"}, "temperature"),  # known, invalid
    ({"use_beam_search": True}, "use_beam_search"),  # known to vLLM, changes the output, not implemented
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
])
def test_known_fields_that_are_invalid_or_unimplemented_are_a_400(client: openai.OpenAI, extra: dict[str, object],
                                                                  param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=REF, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body=extra)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error


# -- item 2: the model's generation_config.json, stored in the snapshot --------------------------------------


def test_generation_config_eos_ids_stop_a_request(client: openai.OpenAI, greedy_ids: list[int]) -> None:
    r = client.completions.create(model=REF, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 4  # the stop id is the 4th token, as EOS counts
    ignoring = client.completions.create(model=REF, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert ignoring.choices[0].finish_reason == "length" and ignoring.usage.completion_tokens == 8  # type: ignore[union-attr]


def test_generation_config_sampling_applies_to_fields_left_out(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=REF, prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
    # No temperature or top_k: the model's top_k 1 makes any seed's sample the greedy one.
    defaults = {client.completions.create(model=REF, prompt=PROMPT, max_tokens=3, seed=s).choices[0].text
                for s in range(4)}
    assert defaults == {greedy}
    # A request's own fields win over the model's.
    own = {client.completions.create(model=REF, prompt=PROMPT, max_tokens=3, seed=s, temperature=1.0,
                                     extra_body={"top_k": 0}).choices[0].text for s in range(4)}
    assert own != {greedy}


# -- item 3: chat_template_kwargs and documents reach the template ---------------------------------------------


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    default = client.chat.completions.create(model=REF, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    off = client.chat.completions.create(model=REF, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # Qwen3's template writes an empty <think>\n\n</think>\n\n after the generation prompt when thinking is off.
    assert default.usage is not None and off.usage is not None
    assert off.usage.prompt_tokens > default.usage.prompt_tokens
    assert ignored_count(server, "chat_template_kwargs") == 0
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs cannot set 'messages'"):
        client.chat.completions.create(model=REF, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                       extra_body={"chat_template_kwargs": {"messages": []}})


# -- item 5: SentencePiece-style tokenizers keep the first generated token's leading space -----------------------


@pytest.fixture(scope="module")
def metaspace_server(tiny_model_dir,  # type: ignore[no-untyped-def]
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str, str]]:
    """A server on the tiny llama with a Metaspace tokenizer, a prompt, and what its greedy continuation adds to
    the decoded text (computed in-process): a prompt whose first generated token is a word with its space."""
    root = tmp_path_factory.mktemp("metaspace")
    model = metaspace_model_dir(tiny_model_dir("llama"), root / "model")
    llm = LLM.from_hf(model, dtype="float32", num_kv_blocks=64)
    tok = llm.tokenizer
    for prompt in ("Hello", "Once upon a time", "The weather today is", "Numbers like 12"):
        ids = tok.encode(prompt)
        out = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
        if tok.hf.id_to_token(out[0]).startswith("▁"):
            break
    else:
        raise AssertionError("no prompt's first greedy token starts a word")
    continuation = tok.decode(ids + out)[len(tok.decode(ids)):]
    assert continuation.startswith(" ")
    s = ServerProcess(build_tiny_snapshot(model, root), "--num-kv-blocks", "128", "--max-model-len", "256")
    s.wait_for("ready")
    yield s, prompt, continuation
    assert s.stop() == 0


def test_sentencepiece_completions_keep_the_first_tokens_space(
        metaspace_server: tuple[ServerProcess, str, str]) -> None:
    server, prompt, continuation = metaspace_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    args = {"model": REF, "prompt": prompt, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    assert client.completions.create(**args).choices[0].text == continuation  # type: ignore[call-overload]
    chunks = client.completions.create(stream=True, **args)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == continuation


# -- item 4: --reasoning-parser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ThinkingModel]]:
    root = tmp_path_factory.mktemp("thinking")
    model = thinking_model_dir(root, [{"role": "user", "content": "What is 7 + 5?"}])
    s = ServerProcess(build_tiny_snapshot(model.dir, root), "--num-kv-blocks", "128", "--max-model-len", "256",
                      "--reasoning-parser", "qwen3")
    s.wait_for("ready")
    yield s, model
    assert s.stop() == 0


def test_reasoning_parser_splits_the_thinking_out(thinking: tuple[ServerProcess, ThinkingModel]) -> None:
    server, model = thinking
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    args: dict[str, Any] = {"model": REF, "messages": model.messages, "max_tokens": REPLY_TOKENS, "temperature": 0,
                            "extra_body": {"ignore_eos": True}}
    message = client.chat.completions.create(**args).choices[0].message
    assert getattr(message, "reasoning_content", None) == model.reasoning
    assert message.content == model.content
    chunks = list(client.chat.completions.create(stream=True, **args))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == model.reasoning
    assert "".join(d.content or "" for d in deltas) == model.content
    # The completions API has no messages: its text is the model's own.
    raw = client.completions.create(model=REF, prompt="Hi", max_tokens=2).choices[0]
    assert not hasattr(raw, "reasoning_content")


def test_responses_leave_the_thinking_out_of_the_output_text(thinking: tuple[ServerProcess, ThinkingModel]) -> None:
    server, model = thinking
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    args: dict[str, Any] = {"model": REF, "input": model.messages, "max_output_tokens": REPLY_TOKENS,
                            "temperature": 0, "extra_body": {"ignore_eos": True}}
    assert client.responses.create(**args).output_text == model.content
    events = list(client.responses.create(stream=True, **args))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == model.content
    assert events[-1].response.output_text == model.content  # type: ignore[union-attr]


def test_enable_thinking_false_gives_content_only(thinking: tuple[ServerProcess, ThinkingModel]) -> None:
    server, model = thinking
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    message = client.chat.completions.create(
        model=REF, messages=model.messages, max_tokens=REPLY_TOKENS, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert getattr(message, "reasoning_content", "absent") is None
    assert message.content and "<think>" not in message.content
