"""Tool calls through the official `openai` client against a real `warmstart serve` process: a tiny random model
behind Qwen2.5's chat template (Hermes-style <tool_call> blocks). tool_choice "required" and a named function
force valid calls out of its garbage; they come back as message.tool_calls, streamed as delta.tool_calls, and
go back in as the history of a second turn."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.serving import KEY, ServerProcess, build_tiny_snapshot
from tests.support.tools import MESSAGES, TOOLS

QWEN_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja"


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("tools")
    model = root / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE.read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    server = ServerProcess(build_tiny_snapshot(model, root), "--num-kv-blocks", "512", "--max-model-len", "1024")
    server.wait_for("ready")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert server.stop() == 0


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 300,
                                             "tools": TOOLS, "seed": 0, **kwargs})


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_required_yields_a_valid_call(client: openai.OpenAI) -> None:
    for seed in range(3):
        choice = ask(client, tool_choice="required", parallel_tool_calls=False, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    choice = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    check_call(choice.message.tool_calls[0])


def test_auto_on_a_random_model_is_plain_content(client: openai.OpenAI) -> None:
    choice = ask(client, tool_choice="auto", max_tokens=20).choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_streamed_calls_reassemble_to_the_whole_response(client: openai.OpenAI) -> None:
    whole = ask(client, tool_choice="required", seed=4).choices[0]
    chunks = list(ask(client, tool_choice="required", seed=4, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_second_turn_with_the_tool_result(client: openai.OpenAI) -> None:
    first = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    second = ask(client, messages=history, tool_choice="none", max_tokens=10)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    # The call and its result are in the prompt the template rendered.
    assert second.usage.prompt_tokens > ask(client, tool_choice="none", max_tokens=1).usage.prompt_tokens + 10


@pytest.mark.parametrize(("body", "problem"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "function.name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id is required"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "already constrains"),
])  # fmt: skip
def test_bad_tool_requests_are_a_400(client: openai.OpenAI, body: dict[str, Any], problem: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, **body)
    assert problem in caught.value.message


def test_tool_call_parser_flag_reads_calls_under_a_template_without_a_format(tiny_model_dir,  # type: ignore[no-untyped-def]
                                                                             tmp_path: Path) -> None:
    snap = build_tiny_snapshot(tiny_model_dir("llama"), tmp_path)  # its template shows no tool-call format
    server = ServerProcess(snap, "--num-kv-blocks", "256", "--max-model-len", "1024", "--tool-call-parser", "hermes")
    try:
        server.wait_for("ready")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        choice = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls"
        check_call(choice.message.tool_calls[0])
    finally:
        assert server.stop() == 0


# -- a template that shows no tool-call format, no --tool-call-parser -------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("plain")
    server = ServerProcess(build_tiny_snapshot(tiny_model_dir("llama"), root), "--num-kv-blocks", "512",
                           "--max-model-len", "1024")  # its ChatML template renders role and content only
    server.wait_for("ready")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert server.stop() == 0


def test_forced_calls_work_without_a_format(plain: openai.OpenAI) -> None:
    """As vLLM forces them through structured outputs: required and a named function work on every model."""
    for seed in range(2):
        choice = ask(plain, tool_choice="required", seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
    named = ask(plain, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]
    check_call(named.message.tool_calls[0])
    single = ask(plain, tool_choice="required", parallel_tool_calls=False, seed=3).choices[0]
    assert len(single.message.tool_calls) == 1


def test_forced_calls_stream_as_the_whole_response_gives_them(plain: openai.OpenAI) -> None:
    whole = ask(plain, tool_choice="required", seed=5).choices[0]
    chunks = list(ask(plain, tool_choice="required", seed=5, stream=True))
    streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole.message.tool_calls)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_without_a_format_says_what_works(plain: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(plain, tool_choice="auto")
    assert "--tool-call-parser" in caught.value.message and 'tool_choice "required"' in caught.value.message


def test_the_next_turn_takes_the_tool_result_and_shows_the_call(plain: openai.OpenAI) -> None:
    first = ask(plain, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}
    with_call = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, result]
    second = ask(plain, messages=with_call, tool_choice="none", max_tokens=10)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    # The template ignores tool_calls: the call is written into the assistant's turn, as it was forced.
    empty = ask(plain, messages=[*MESSAGES, {"role": "assistant", "content": ""}, result], tool_choice="none",
                max_tokens=1)
    forced = json.dumps([{"name": call.function.name, "parameters": json.loads(call.function.arguments)}])
    assert second.usage.prompt_tokens > empty.usage.prompt_tokens + len(forced) // 8
