"""Fuzzed request bodies: whatever a client sends, the answer is a 200 or a 4xx with an OpenAI error body, never
a 500, and the engine is left idle and serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tests.support.serving import REF, SYSTEM_TEXT, TinySnapshot, build_tiny_snapshot, error_of, ready_state
from warmstart.handlers.server.app import create_app
from warmstart.handlers.server.state import Limits, ServeState


@pytest.fixture(scope="module")
def state(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeState]:  # type: ignore[no-untyped-def]
    snap: TinySnapshot = build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("fuzz"))
    # A short context bounds how long any accepted request can generate.
    s = ready_state(snap, Limits(max_body_bytes=16384), max_model_len=192, num_kv_blocks=32)
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def client(state: ServeState) -> Iterator[TestClient]:
    with TestClient(create_app(state)) as c:
        yield c


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
wild = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)


def mostly(valid: st.SearchStrategy[Any], edgy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid values most of the time, so that bodies get through to the engine; else near or past the range, or
    anything at all."""
    return st.integers(0, 9).flatmap(lambda i: valid if i < 8 else edgy if i == 8 else wild)


text = st.text(max_size=30)
token_ids = st.lists(st.integers(min_value=3, max_value=999), min_size=1, max_size=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.one_of(text, st.just(SYSTEM_TEXT))})
bad_message = st.fixed_dictionaries({"role": st.sampled_from(["tool", "", "USER"]) | wild, "content": wild})
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": mostly(st.just(REF), st.just("other")),
    "max_tokens": mostly(st.integers(1, 8), st.integers(-2, 0) | st.integers(90, 2**40)),
    "temperature": mostly(st.floats(0, 2), st.floats(-1, 200) | st.just(float("nan"))),
    "top_p": mostly(st.floats(0.01, 1), st.floats(-1, 2)),
    "top_k": mostly(st.integers(-1, 50), st.integers(-5, 10**6)),
    "min_p": mostly(st.floats(0, 1), st.floats(-1, 2)),
    "seed": mostly(st.integers(0, 2**32), st.integers(-(2**66), 2**66)),
    "stop": mostly(st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
                   st.lists(st.text(max_size=2), max_size=20)),
    "stop_token_ids": mostly(token_ids, st.lists(st.integers(-5, 2000), max_size=3)),
    "ignore_eos": mostly(st.booleans(), st.integers(0, 1)),
    "n": mostly(st.just(1), st.integers(0, 3)),
    "stream": mostly(st.booleans(), st.just("yes")),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}),
                             st.fixed_dictionaries({"include_usage": st.booleans(), "other": st.booleans()})),
    "prefix": mostly(st.sampled_from(["assistant", "doc"]), st.just("nope")),
    "user": mostly(text, st.integers()),
    "frequency_penalty": mostly(st.just(0), st.floats(-2, 2)),
    "presence_penalty": mostly(st.floats(-2, 2), st.floats(-5, 5) | st.just("x")),
    "repetition_penalty": mostly(st.floats(0.5, 2), st.floats(-1, 3)),
    "logit_bias": mostly(st.dictionaries(st.integers(0, 999).map(str), st.floats(-100, 100), max_size=3),
                         st.dictionaries(st.text(max_size=3), st.floats(-200, 200) | st.text(), max_size=3)),
    "min_tokens": mostly(st.integers(0, 4), st.integers(-2, 10**6)),
    "bad_words": mostly(st.lists(st.text(min_size=1, max_size=4), max_size=3), st.lists(st.integers(), max_size=2)),
}
COMPLETION = {**SAMPLING, "logprobs": mostly(st.integers(0, 5), st.integers(-1, 30) | st.booleans()),
              "echo": mostly(st.just(False), st.just(True)), "best_of": mostly(st.integers(1, 3), st.integers(-1, 50))}
CHAT = {**SAMPLING, "max_completion_tokens": mostly(st.integers(1, 8), st.integers(-1, 10**6)),
        "logprobs": mostly(st.booleans(), st.integers(0, 5)), "top_logprobs": mostly(st.integers(0, 5),
                                                                                     st.integers(-1, 30)),
        "response_format": mostly(st.just({"type": "text"}), st.just({"type": "json_object"}))}

completion_bodies = st.fixed_dictionaries(
    {"prompt": mostly(text | token_ids, st.lists(st.integers(-5, 2000), max_size=4) | st.lists(text, max_size=3))},
    optional=COMPLETION)
chat_bodies = st.fixed_dictionaries(
    {"messages": mostly(st.lists(message, min_size=1, max_size=3), st.lists(bad_message, max_size=2))},
    optional=CHAT)


def check(response: Any) -> None:
    event(f"status {response.status_code}")
    assert response.status_code != 500, response.text
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n") or '"error"' in response.text
        else:
            assert response.json()["choices"]
    else:
        assert 400 <= response.status_code < 500, response.text
        error_of(response)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=completion_bodies)
def test_completion_bodies_never_give_a_500(client: TestClient, body: dict[str, Any]) -> None:
    check(client.post("/v1/completions", content=json.dumps(body).encode()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=chat_bodies)
def test_chat_bodies_never_give_a_500(client: TestClient, body: dict[str, Any]) -> None:
    check(client.post("/v1/chat/completions", content=json.dumps(body).encode()))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=64) | wild.map(lambda v: json.dumps(v).encode()),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bodies_never_give_a_500(client: TestClient, raw: bytes, path: str) -> None:
    check(client.post(path, content=raw))


def test_the_engine_is_idle_and_serving_after_the_fuzz(client: TestClient, state: ServeState) -> None:
    ok = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
    assert ok.status_code == 200
    assert state.service is not None and state.service.in_flight == 0 and state.service.llm.is_alive
    metrics = client.get("/metrics").text
    assert 'warmstart:num_requests_running{model_name="tiny"} 0.0' in metrics
    assert 'warmstart:num_requests_waiting{model_name="tiny"} 0.0' in metrics
