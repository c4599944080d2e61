"""Structured outputs through the official `openai` client against a real `warmstart serve` process on a tiny
random model: its garbage parses and validates only because the grammar holds it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.schemas import PERSON_SCHEMA
from tests.support.serving import KEY, ServerProcess, build_tiny_snapshot

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    snap = build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("structured"))
    server = ServerProcess(snap, "--num-kv-blocks", "512", "--max-model-len", "512")
    server.wait_for("ready")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert server.stop() == 0


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=250, **kwargs)


def test_chat_json_schema_parses_and_validates(client: openai.OpenAI) -> None:
    for seed in range(3):
        choice = chat(client, response_format=PERSON_FORMAT, seed=seed).choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


def test_without_the_format_the_same_requests_are_not_json(client: openai.OpenAI) -> None:
    for seed in range(3):
        with pytest.raises(ValueError):
            json.loads(chat(client, seed=seed).choices[0].message.content)


def test_chat_json_object(client: openai.OpenAI) -> None:
    # Greedy: an object's keys are free strings, which a random model's samples seldom close within max_tokens.
    choice = chat(client, response_format={"type": "json_object"}, temperature=0).choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


def test_completions_response_format_and_vllm_fields(client: openai.OpenAI) -> None:
    def complete(**body: Any) -> Any:
        return client.completions.create(model="tiny", prompt="Answer:", max_tokens=250, seed=3,
                                         extra_body=body).choices[0]

    person = complete(response_format=PERSON_FORMAT)
    jsonschema.validate(json.loads(person.text), PERSON_SCHEMA)
    assert complete(guided_choice=["red", "green", "blue"]).text in ("red", "green", "blue")
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", complete(guided_regex=r"[A-Z]{2}-[0-9]{4}").text)
    jsonschema.validate(json.loads(complete(guided_json=PERSON_SCHEMA).text), PERSON_SCHEMA)
    assert complete(structured_outputs={"choice": ["up", "down"]}).text in ("up", "down")
    assert re.fullmatch(r"[0-9]{1,3}\.[0-9]", complete(structured_outputs={"regex": r"[0-9]{1,3}\.[0-9]"}).text)


def test_streamed_json_schema_reassembles_to_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=250, seed=1, stream=True,
                                            response_format=PERSON_FORMAT)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_constrained_and_free_requests_at_once_are_both_right(client: openai.OpenAI) -> None:
    alone = chat(client, seed=11).choices[0].message.content
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(chat, client, response_format=PERSON_FORMAT, seed=s) for s in range(20, 24)]
        free = [pool.submit(chat, client, seed=11) for _ in range(2)]
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), PERSON_SCHEMA)
        assert [f.result().choices[0].message.content for f in free] == [alone, alone]


@pytest.mark.parametrize(("body", "problem"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "Invalid type: foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "/$defs/missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "name is required"),
    ({"response_format": {"type": "xml"}}, "response_format must be"),
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"guided_choice": []}, "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "send one of them"),
    # 60,000 choices once took ~2 s to check in the parsing pool every request shares
    ({"guided_choice": [f"c{i}" for i in range(60_000)]}, "60000 choices; at most 4096"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(4097)]}}, "4097 choices; at most 4096"),
])  # fmt: skip
def test_invalid_constraints_are_a_400_naming_the_problem(client: openai.OpenAI, body: dict[str, Any],
                                                          problem: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body=body)
    assert problem in caught.value.message
    assert caught.value.body["param"] in body  # type: ignore[index]


def test_the_largest_choice_list_accepted_is_served(client: openai.OpenAI) -> None:
    choices = [f"label {i}" for i in range(4096)]  # past llguidance's 2,000 parser items a row
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20,
                                           extra_body={"guided_choice": choices})
    assert reply.choices[0].message.content in choices


def test_every_choice_of_n_follows_the_schema(client: openai.OpenAI) -> None:
    # The choices fork from one prompt: each must advance a matcher of its own.
    choices = chat(client, response_format=PERSON_FORMAT, n=3, seed=5).choices
    assert len(choices) == 3 and len({c.message.content for c in choices}) > 1
    for c in choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON_SCHEMA)
