"""The HTTP API in-process (Starlette's TestClient) on a tiny model's snapshot: shapes OpenAI clients rely on,
prefix hits, streaming, errors, auth, the queue limit and metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.support.serving import REF, SYSTEM_TEXT, TinySnapshot, build_tiny_snapshot, error_of, ready_state
from warmstart.handlers.server.app import create_app
from warmstart.handlers.server.state import Limits, ServeState
from warmstart.handlers.server.timeline import cold_start_timeline
from warmstart.runtime import LLM, SamplingParams
from warmstart.snapshot.loader import load

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def state(snap: TinySnapshot) -> Iterator[ServeState]:
    s = ready_state(snap, Limits(max_queue=0, max_body_bytes=4096), max_num_seqs=4)
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def reference(snap: TinySnapshot) -> LLM:
    """The same snapshot on the offline face: what the server's greedy answers must equal."""
    return load(REF, store=str(snap.store), cache=snap.cache, num_kv_blocks=64)


@pytest.fixture(scope="module")
def client(state: ServeState) -> Iterator[TestClient]:
    with TestClient(create_app(state)) as c:
        yield c


def sse_events(text: str) -> list[Any]:
    lines = [line for line in text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def chat(system: str | None, user: str = "Hi there", **extra: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": REF, "messages": messages, **GREEDY, **extra}


# -- readiness --------------------------------------------------------------------------------------------------


def test_health_is_503_and_requests_are_refused_until_the_engine_is_ready() -> None:
    loading = ServeState(REF, REF, cold_start_timeline())
    with TestClient(create_app(loading)) as c:
        health = c.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        refused = c.post("/v1/completions", json={"prompt": "Hi"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "loading" in error_of(refused)["message"]
        assert c.get("/status").json()["status"] == "loading"
        assert c.get("/metrics").status_code == 200  # the cold start is visible while it happens


def test_health_status_and_models_once_ready(client: TestClient, snap: TinySnapshot) -> None:
    assert client.get("/health").json() == {"status": "ready"}
    status = client.get("/status").json()
    assert status["status"] == "ready" and status["snapshot_id"] == snap.id and status["adapters"] == []
    assert {p["name"]: p["cached_tokens"] for p in status["prefixes"]} == snap.cached_tokens
    phases = status["phases"]
    assert list(phases)[:2] == ["process_start", "runtime_imports"]  # in-process: no imports/listening marks
    assert phases["runtime_imports"] <= phases["manifest"] <= phases["blobs"] <= phases["mapped"] <= phases["ready"]
    assert status["details"]["blobs"]["blobs_downloaded"] == 0  # the build left every blob in the cache
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == REF and models["data"][0]["root"] == snap.id


# -- completions ------------------------------------------------------------------------------------------------


def test_completion_matches_the_engine_and_reports_usage(client: TestClient, reference: LLM) -> None:
    r = client.post("/v1/completions", json={"model": REF, "prompt": "Once upon a time", **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == REF
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    want = reference.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert choice["text"] == want.text
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(want.prompt_token_ids) and usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8 and "cached_tokens" in usage["prompt_tokens_details"]


def test_token_id_prompts_and_stop_token_ids(client: TestClient, reference: LLM) -> None:
    prompt = [5, 6, 7, 8]
    first = client.post("/v1/completions", json={"prompt": prompt, **GREEDY, "logprobs": 1}).json()
    assert first["usage"]["prompt_tokens"] == 4
    assert [len(top) for top in first["choices"][0]["logprobs"]["top_logprobs"]] == [1] * 8
    want = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert first["choices"][0]["text"] == want.text
    stopped = client.post("/v1/completions", json={"prompt": prompt, **GREEDY, "stop_token_ids": [want.token_ids[2]]})
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    assert stopped.json()["usage"]["completion_tokens"] == want.token_ids.index(want.token_ids[2]) + 1


def test_logprobs_have_one_entry_per_token(client: TestClient) -> None:
    c = client.post("/v1/completions", json={"prompt": "The cat", **GREEDY, "logprobs": 3}).json()
    lp = c["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    assert all(len(top) <= 3 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert all(v <= 0 for v in lp["token_logprobs"])
    ch = client.post("/v1/chat/completions", json=chat(None, logprobs=True, top_logprobs=2)).json()
    content = ch["choices"][0]["logprobs"]["content"]
    assert len(content) == 8
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
               for e in content)


# -- prefixes ---------------------------------------------------------------------------------------------------


def test_a_chat_whose_system_message_is_the_snapshot_prefix_hits_it(client: TestClient, snap: TinySnapshot) -> None:
    r = client.post("/v1/chat/completions", json=chat(SYSTEM_TEXT))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == snap.cached_tokens["assistant"] >= 32


def test_the_prefix_field_gives_the_same_prompt_as_the_system_message(client: TestClient, snap: TinySnapshot) -> None:
    explicit = client.post("/v1/chat/completions", json=chat(None, prefix="assistant")).json()
    implicit = client.post("/v1/chat/completions", json=chat(SYSTEM_TEXT)).json()
    assert explicit["usage"] == implicit["usage"]
    assert explicit["choices"][0]["message"] == implicit["choices"][0]["message"]
    doc = client.post("/v1/completions", json={"prompt": " And then", "prefix": "doc", **GREEDY}).json()
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == snap.cached_tokens["doc"] > 0


def test_unknown_prefix_lists_the_known_ones(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "prefix": "nope"})
    error = error_of(r)
    assert r.status_code == 400 and error["param"] == "prefix"
    assert "assistant" in error["message"] and "doc" in error["message"]
    both = client.post("/v1/chat/completions", json=chat(SYSTEM_TEXT, prefix="assistant"))
    assert both.status_code == 400 and error_of(both)["param"] == "prefix"


# -- streaming --------------------------------------------------------------------------------------------------


def test_streamed_completion_concatenates_to_the_whole_one(client: TestClient) -> None:
    whole = client.post("/v1/completions", json={"prompt": "Once upon a time", **GREEDY}).json()
    r = client.post("/v1/completions", json={"prompt": "Once upon a time", **GREEDY, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    *chunks, final = events
    assert final["choices"] == [] and final["usage"] == whole["usage"]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert len({c["id"] for c in events}) == 1


def test_streamed_chat_starts_with_the_role_and_ends_with_the_reason(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=chat(SYSTEM_TEXT, stream=True))
    chunks = sse_events(r.text)
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = client.post("/v1/chat/completions", json=chat(SYSTEM_TEXT)).json()
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == whole["choices"][0]["message"]["content"]


def test_stream_sends_a_chunk_per_token_while_its_text_is_held_back(client: TestClient) -> None:
    """A stop string longer than the reply holds its text back until the end; each token still gets its chunk,
    with empty text, as vLLM streams (its load tester times inter-token latency by chunks), and the texts still
    add up to the whole reply. Chat the same, with empty content deltas."""
    never = {"stop": ["~" * 64]}  # 63 characters held back at every step
    whole = client.post("/v1/completions", json={"prompt": "Once upon a time", **GREEDY, **never}).json()
    r = client.post("/v1/completions", json={"prompt": "Once upon a time", **GREEDY, **never, "stream": True})
    chunks = sse_events(r.text)
    assert len(chunks) == whole["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert chunks[1]["choices"][0]["text"] == ""
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    chunks = sse_events(client.post("/v1/chat/completions", json=chat(SYSTEM_TEXT, stream=True, **never)).text)
    assert len(chunks) == GREEDY["max_tokens"] and chunks[1]["choices"][0]["delta"] == {"content": ""}


# -- errors -----------------------------------------------------------------------------------------------------

LONG = list(range(5, 305))  # 300 tokens: more than max_model_len 256


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", b"", 400, None, "empty"),
        ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
        ("/v1/completions", b"[" * 4000, 400, None, "nested"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search", "not supported"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", "boolean"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of", "at least n"),
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed", "seed"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
         "stream"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty", "[-2, 2]"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
        ("/v1/completions", {"prompt": ["a", [1, 2]]}, 400, "prompt", "all strings or all arrays of token ids"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "[0, 1000)"),
        ("/v1/completions", {"prompt": LONG}, 400, "prompt", "300 tokens"),
        ("/v1/completions", {"prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens", "300 in all"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "not served"),
        ("/v1/completions", {}, 400, "prompt", "required"),
        ("/v1/chat/completions", {"model": REF}, 400, "messages", "required"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "tool_call_id"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages", "text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400,
         "messages", "tool_calls"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs", "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         400, "tools", "must be {type: function"),
        ("/v1/completions", {"prompt": "x" * 5000}, 413, None, "4096"),
    ],
)
def test_client_mistakes_are_4xx_with_an_openai_error_body(client: TestClient, path: str, body: Any, status: int,
                                                           param: str | None, words: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = error_of(r)
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_unknown_routes_and_methods_get_json_errors(client: TestClient) -> None:
    assert error_of(client.get("/v1/nothing"))["message"].startswith("no route")
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "GET" in error_of(r)["message"]


def test_the_engine_is_idle_and_serving_after_the_errors(client: TestClient, state: ServeState) -> None:
    test_client_mistakes_are_4xx_with_an_openai_error_body(client, "/v1/completions", {"prompt": LONG}, 400, "prompt",
                                                            "300 tokens")
    assert client.post("/v1/completions", json={"prompt": "x", **GREEDY}).status_code == 200
    assert state.service is not None and state.service.in_flight == 0
    metrics = client.get("/metrics").text
    assert 'warmstart:num_requests_running{model_name="tiny"} 0.0' in metrics


# -- auth, limits, metrics ---------------------------------------------------------------------------------------


def test_api_key_guards_every_route_but_health(snap: TinySnapshot) -> None:
    keyed = ServeState(REF, REF, cold_start_timeline(), Limits(api_key=KEY))
    with TestClient(create_app(keyed)) as c:
        assert c.get("/health").status_code == 503  # no key needed; still loading
        for path in ("/v1/models", "/status", "/metrics"):
            r = c.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert error_of(r)["code"] == "invalid_api_key"
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": KEY}).status_code == 401  # the scheme is required
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_past_the_queue_limit_requests_get_429_with_retry_after(client: TestClient) -> None:
    # max_num_seqs 4 and max_queue 0: four requests in flight fill the server.
    long = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    streams = [client.stream("POST", "/v1/completions", json=long) for _ in range(4)]
    try:
        for s in streams:
            assert s.__enter__().status_code == 200
        r = client.post("/v1/completions", json={"prompt": "x", **GREEDY})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert error_of(r)["type"] == "rate_limit_error"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    assert client.post("/v1/completions", json={"prompt": "x", **GREEDY}).status_code == 200


def test_metrics_carry_the_vllm_names(client: TestClient) -> None:
    client.post("/v1/chat/completions", json=chat(SYSTEM_TEXT))
    text = client.get("/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_sum", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "request_success_total"):
        assert f"warmstart:{name}" in text, name
    assert 'warmstart:cold_start_seconds{phase="ready"}' in text
    assert 'warmstart:request_success_total{finished_reason="length",model_name="tiny"}' in text
    hits = next(line for line in text.splitlines() if line.startswith("warmstart:prefix_cache_hits_total"))
    assert float(hits.split()[-1]) >= 32


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_an_engine_failing_mid_stream_ends_the_stream_with_one_error(snap: TinySnapshot, path: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The status line is long sent: the failure is the stream's last message, in its API's own shape (chat's
    error chunk, the Responses API's error event), and nothing follows it."""
    failing = ready_state(snap)
    assert failing.service is not None
    runner = failing.service.llm.engine.runner
    real_run, calls = runner.run, []

    def lost_after_three(batch: Any) -> Any:
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return real_run(batch)

    monkeypatch.setattr(runner, "run", lost_after_three)
    body = ({"input": "Once upon a time", "max_output_tokens": 32} if path == "/v1/responses" else
            {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 32})
    try:
        with TestClient(create_app(failing)) as c, c.stream("POST", path, json={
                "model": REF, "stream": True, "temperature": 0, "ignore_eos": True, **body}) as r:
            assert r.status_code == 200
            messages = [m for m in r.read().decode().split("\n\n") if m]
    finally:
        failing.shutdown()
    last = json.loads(messages[-1].split("data: ", 1)[1])
    if path == "/v1/responses":
        assert messages[-1].startswith("event: error\n") and last["type"] == "error"
        assert "device lost" in last["message"] and last["sequence_number"] == len(messages) - 1
        assert [json.loads(m.split("data: ", 1)[1])["type"] for m in messages[:4]] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        assert not any("response.completed" in m for m in messages)
    else:
        assert set(last) == {"error"} and "device lost" in last["error"]["message"]
        assert "data: [DONE]" not in messages


def test_a_stopped_engine_makes_health_503_and_requests_503(snap: TinySnapshot) -> None:
    stopped = ready_state(snap)
    assert stopped.service is not None
    stopped.service.llm.shutdown()
    with TestClient(create_app(stopped)) as c:
        assert c.get("/health").status_code == 503 and c.get("/health").json() == {"status": "engine_stopped"}
        r = c.post("/v1/completions", json={"prompt": "x", **GREEDY})
        assert r.status_code == 503 and error_of(r)["type"] == "server_error"
        assert stopped.service.in_flight == 0


def test_text_far_too_long_for_the_context_is_refused_by_its_length(snap: TinySnapshot) -> None:
    short = ready_state(snap, max_model_len=64)  # longest vocabulary entry 13 chars: over 1,664 chars cannot fit
    with TestClient(create_app(short)) as c:
        r = c.post("/v1/completions", json={"prompt": "word " * 400})
        assert r.status_code == 400 and "2000 characters" in error_of(r)["message"]
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 400}]})
        assert chat.status_code == 400 and error_of(chat)["code"] == "context_length_exceeded"
    short.shutdown()


def test_json_cut_by_max_tokens_ends_with_length(client: TestClient) -> None:
    """A model that does not close its JSON (here a string the schema wants long) runs to max_tokens: the reply is
    not JSON and finish_reason says length (as vLLM); only one that ends with stop is promised to parse."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 64}}, "required": ["s"]}
    body = chat(None, max_tokens=6, ignore_eos=False,
                response_format={"type": "json_schema", "json_schema": {"name": "long", "schema": schema}})
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith('{"s": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])
