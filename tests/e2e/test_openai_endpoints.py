"""Endpoints and headers clients expect beside chat and completions, through the official `openai` client against a
real `warmstart serve` process: /v1/responses as the Agents SDK calls it (whole and streamed), several prompts in
one /v1/completions request, /tokenize and /detokenize, X-Request-Id, the access log, CORS, SSE pings."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from tests.support.serving import AUTH, KEY, REF, ServerProcess, TinySnapshot, build_tiny_snapshot, ready_state
from warmstart.handlers.server.app import create_app
from warmstart.handlers.server.state import Limits
from warmstart.runtime.tokenizer import Tokenizer

ORIGIN = "https://app.example.com"
SECRET_PROMPT = "zebra marmalade quantum harbour"  # must never reach the access log
# What the OpenAI Agents SDK (OpenAIResponsesModel) sends for Runner.run(agent, "...") with no tools.
AGENTS_SDK = {"instructions": "You are a helpful assistant.", "tools": [], "include": [],
              "extra_headers": {"User-Agent": "Agents/Python 0.24.0"}}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("endpoints"))


@pytest.fixture(scope="module")
def server(snap: TinySnapshot) -> Iterator[ServerProcess]:
    # One sequence at a time, so a second request waits in the queue; pings every 50 ms.
    s = ServerProcess(snap, "--num-kv-blocks", "256", "--max-model-len", "512", "--max-num-seqs", "1",
                      "--sse-ping-seconds", "0.05", "--allowed-origins", f"{ORIGIN},https://other.example.com")
    s.wait_for("ready")
    yield s
    assert s.stop() == 0


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> str:
    r = client.chat.completions.create(model=REF, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                       **GREEDY)  # type: ignore[arg-type]
    return r.choices[0].message.content or ""


# -- /v1/responses ---------------------------------------------------------------------------------------------


def test_responses_as_the_agents_sdk_calls_it(client: openai.OpenAI) -> None:
    r = client.responses.create(model=REF, input=[{"content": "Tell me a story", "role": "user"}],
                                max_output_tokens=6, **AGENTS_SDK, **GREEDY)  # type: ignore[arg-type]
    want = chat_text(client, [{"role": "system", "content": AGENTS_SDK["instructions"]},  # type: ignore[dict-item]
                              {"role": "user", "content": "Tell me a story"}], 6)
    assert r.object == "response" and r.status == "incomplete" and r.model == REF
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == want != ""
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage is not None and r.usage.output_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    # A plain string input, and the history's assistant output item sent back as the SDK does on a second turn.
    again = client.responses.create(model=REF, input=[
        {"content": "Tell me a story", "role": "user"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r.output_text,
                                                              "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "More"}]}], max_output_tokens=3, **GREEDY)
    assert again.output_text == chat_text(client, [{"role": "user", "content": "Tell me a story"},
                                                   {"role": "assistant", "content": r.output_text},
                                                   {"role": "user", "content": "More"}], 3)
    assert client.responses.create(model=REF, input="Hi", max_output_tokens=2, **GREEDY).output_text == \
        chat_text(client, [{"role": "user", "content": "Hi"}], 2)


def test_responses_stream_the_event_sequence(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=REF, input="Once upon a time", max_output_tokens=8, **AGENTS_SDK,
                                    **GREEDY)  # type: ignore[arg-type]
    events = list(client.responses.create(model=REF, input="Once upon a time", max_output_tokens=8, stream=True,
                                          **AGENTS_SDK, **GREEDY))  # type: ignore[arg-type]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(deltas) >= 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 8
    # The SDK's own stream helper checks that every event fits the ones before it.
    with client.responses.stream(model=REF, input="Once upon a time", max_output_tokens=8, **AGENTS_SDK,
                                 **GREEDY) as stream:  # type: ignore[arg-type]
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"background": True}, "background"),
    ({"n": 2}, "n"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
])
def test_responses_refuse_what_they_cannot_serve(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=REF, input="Hi", max_output_tokens=2, extra_body=extra)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


def test_responses_ignore_what_does_not_change_the_text(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=REF, input="Hi", max_output_tokens=3, **GREEDY)
    dressed = client.responses.create(model=REF, input="Hi", max_output_tokens=3, store=False, metadata={"k": "v"},
                                      truncation="disabled", reasoning={"effort": "low"}, parallel_tool_calls=True,
                                      text={"format": {"type": "text"}}, **GREEDY)
    assert dressed.output_text == plain.output_text and dressed.metadata == {"k": "v"}


# -- several prompts in one completions request ----------------------------------------------------------------


def test_several_prompts_get_a_choice_each_indexed_per_prompt(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "The weather today", "In a galaxy"]
    singles = [client.completions.create(model=REF, prompt=p, max_tokens=4, **GREEDY) for p in prompts]
    batch = client.completions.create(model=REF, prompt=prompts, max_tokens=4, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage is not None and batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # type: ignore[union-attr]
    assert batch.usage.completion_tokens == 12
    streamed: dict[int, str] = {}
    chunks = list(client.completions.create(model=REF, prompt=prompts, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: s.choices[0].text for i, s in enumerate(singles)}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    token_prompts = client.completions.create(model=REF, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, **GREEDY)
    assert [c.index for c in token_prompts.choices] == [0, 1]
    assert token_prompts.usage is not None and token_prompts.usage.prompt_tokens == 5


def test_one_bad_prompt_fails_the_request_and_frees_the_others(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=REF, prompt=["fine", "x" * 100_000], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="all strings or all arrays"):
        client.completions.create(model=REF, prompt=["fine", [1, 2]], max_tokens=2)  # type: ignore[list-item]
    assert client.completions.create(model=REF, prompt="still serving", max_tokens=1).choices


# -- /tokenize and /detokenize -----------------------------------------------------------------------------------


def test_tokenize_and_detokenize_in_vllms_shapes(server: ServerProcess, client: openai.OpenAI,
                                                 tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    tok = Tokenizer(tiny_model_dir("llama"))
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        body = http.post("/tokenize", json={"model": REF, "prompt": "Hello world", "return_token_strs": True}).json()
        assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
        bare = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
        assert bare["tokens"] == tok.encode("Hello world", add_special_tokens=False) and bare["token_strs"] is None
        back = http.post("/detokenize", json={"model": REF, "tokens": bare["tokens"]}).json()
        assert back == {"prompt": "Hello world"}
        messages = [{"role": "user", "content": "Hi there"}]
        chat = http.post("/tokenize", json={"messages": messages}).json()
        usage = client.chat.completions.create(model=REF, messages=messages, max_tokens=1).usage  # type: ignore[arg-type]
        assert usage is not None and chat["count"] == usage.prompt_tokens
        for path, body_, param in [("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
                                   ("/tokenize", {"prompt": "x", "model": "other"}, "model")]:
            r = http.post(path, json=body_)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


# -- X-Request-Id and the access log ------------------------------------------------------------------------------


def test_request_ids_are_echoed_or_made_and_every_request_is_logged(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        ok = http.post("/v1/completions", headers={**AUTH, "X-Request-Id": "trace-42.a:b"},
                       json={"model": REF, "prompt": SECRET_PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert ok.headers["x-request-id"] == "trace-42.a:b"
        unauthorized = http.get("/v1/models", headers={"X-Request-Id": "has spaces and <html>"})
        assert unauthorized.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", unauthorized.headers["x-request-id"])
        missing = http.get("/nowhere", headers=AUTH)
        assert missing.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", missing.headers["x-request-id"])
        assert missing.headers["x-request-id"] != unauthorized.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while not any(e.get("request_id") == missing.headers["x-request-id"] for e in server.events):
        assert time.monotonic() < deadline, "no access line for the 404"
        time.sleep(0.05)
    access = [e for e in server.events if e.get("event") == "access"]
    line = next(e for e in access if e["request_id"] == "trace-42.a:b")
    assert line["method"] == "POST" and line["path"] == "/v1/completions" and line["status"] == 200
    assert line["completion_tokens"] == 3 and line["prompt_tokens"] > 0 and line["duration_s"] >= 0
    assert next(e for e in access if e["request_id"] == unauthorized.headers["x-request-id"])["status"] == 401
    assert SECRET_PROMPT not in json.dumps(server.events)


# -- CORS -------------------------------------------------------------------------------------------------------


def test_cors_preflights_are_answered_before_the_api_key(server: ServerProcess) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        allowed = http.options("/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in allowed.headers
        refused = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        actual = http.get("/v1/models", headers={"Origin": ORIGIN, **AUTH})
        assert actual.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in actual.headers["access-control-expose-headers"].lower()
        assert http.get("/v1/models", headers={"Origin": ORIGIN}).status_code == 401  # the key is still needed


def test_no_cors_unless_origins_are_allowed(snap: TinySnapshot) -> None:
    state = ready_state(snap, Limits(api_key=KEY))
    try:
        with TestClient(create_app(state)) as http:
            r = http.options("/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
            assert r.status_code == 401 and "access-control-allow-origin" not in r.headers
            r = http.get("/v1/models", headers={"Origin": ORIGIN, **AUTH})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        state.shutdown()


# -- SSE pings ----------------------------------------------------------------------------------------------------


def test_a_stream_waiting_behind_another_gets_pings(server: ServerProcess) -> None:
    long_body = {"model": REF, "prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True}
    waiting_body = {"model": REF, "prompt": "b", "max_tokens": 2, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=long_body) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # it holds the only sequence slot
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.extend(_drain(http, waiting_body)))
        reader.start()
        reader.join(timeout=60)
    first_data = next(i for i, line in enumerate(got) if line.startswith("data: {"))
    assert ": ping" in got[:first_data], got[:5]
    assert got[-1] == "data: [DONE]"


def _drain(http: httpx.Client, body: dict[str, Any]) -> list[str]:
    with http.stream("POST", "/v1/completions", json=body) as r:
        return [line for line in r.iter_lines() if line]
