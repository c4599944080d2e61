"""Mistral-format tool calls through the official `openai` client against a real `warmstart serve`: a tiny random
model behind Mistral's chat template whose tokenizer has the `[TOOL_CALLS]` special token. tool_choice "required"
and a named function force `[TOOL_CALLS][{...}]` (the grammar begins with that token, by id); the token survives
detokenization (skip_special_tokens is off under the mistral parser), so the calls come back parsed, whole and
streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.mistral_model import mistral_tool_model_dir
from tests.support.serving import KEY, ServerProcess, build_tiny_snapshot
from tests.support.tools import MESSAGES, TOOLS


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("mistral-tools")
    model, _ = mistral_tool_model_dir(root)
    server = ServerProcess(build_tiny_snapshot(model, root), "--num-kv-blocks", "512", "--max-model-len", "1024")
    server.wait_for("ready")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert server.stop() == 0


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 300,
                                             "tools": TOOLS, "seed": 0, **kwargs})


def check_call(call: Any) -> None:
    assert call.type == "function" and len(call.id) == 9 and call.id.isalnum()  # as Mistral templates require
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_yields_mistral_calls(client: openai.OpenAI, parallel: bool) -> None:
    choice = ask(client, tool_choice="required", parallel_tool_calls=parallel).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None  # the [TOOL_CALLS] token does not leak into the content
    assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
    for call in choice.message.tool_calls:
        check_call(call)


def test_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    choice = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    check_call(choice.message.tool_calls[0])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble_to_the_whole_response(client: openai.OpenAI, tool_choice: Any) -> None:
    whole = ask(client, tool_choice=tool_choice, seed=4).choices[0]
    chunks = list(ask(client, tool_choice=tool_choice, seed=4, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert content == "" and whole.message.content is None
    assert whole.message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
