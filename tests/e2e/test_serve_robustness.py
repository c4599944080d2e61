"""Hostile and unlucky clients: lone UTF-16 surrogates, prompts far too long to tokenize, bodies that stall, and
requests still running when a SIGTERM's grace period ends. Over a real `warmstart serve` process where the
connection matters, in-process where the test has to see inside (the tokenizer's calls, the queue count)."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import httpx
import pytest
from starlette.testclient import TestClient

from tests.support.serving import AUTH, KEY, ServerProcess, TinySnapshot, build_tiny_snapshot, error_of, ready_state
from warmstart.handlers.openai.requests import APIError, ServedModel, parse_completion
from warmstart.handlers.server.app import ErrorResponse, create_app
from warmstart.handlers.server.state import Limits, ServeState


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("robust"))


@pytest.fixture(scope="module")
def server(snap: TinySnapshot) -> Iterator[ServerProcess]:
    s = ServerProcess(snap, "--num-kv-blocks", "256", "--max-model-len", "512", "--body-timeout-seconds", "1")
    s.wait_for("ready")
    yield s
    assert s.stop() == 0


# -- lone surrogates -----------------------------------------------------------------------------------------------

GOOD = b'{"prompt": "Hello", "max_tokens": 2}'


@pytest.mark.parametrize(
    ("path", "body", "where"),
    [  # raw JSON text: a lone surrogate can only arrive as an escape
        ("/v1/completions", rb'{"prompt": "a\ud800", "max_tokens": 2}', "prompt holds"),
        ("/v1/completions", rb'{"prompt": ["a\udfff"], "max_tokens": 2}', "prompt[0] holds"),
        ("/v1/completions", rb'{"prompt": "a", "a\ud800": 1}', "a field name holds"),
        ("/v1/completions", rb'{"prompt": "a", "stop": ["x", "\udc00"]}', "stop[1] holds"),
        ("/v1/completions", rb'{"prompt": "a\ude00\ud83d", "max_tokens": 2}', "prompt holds"),  # a pair reversed
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi\ud800"}]}',
         "messages[0].content holds"),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
         "messages[0].content[0].text holds"),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi", "\udbff": 1}]}',
         "a field name of messages[0] holds"),
    ],
)
def test_a_lone_surrogate_is_a_400_and_the_connection_stays_usable(server: ServerProcess, path: str, body: bytes,
                                                                   where: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {**AUTH, "Content-Type": "application/json"}
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert r.status == 400, error
        assert error["message"].startswith(where) and "lone UTF-16 surrogate" in error["message"], error
        assert error["code"] == "invalid_unicode"
        sock = conn.sock
        conn.request("POST", "/v1/completions", body=GOOD, headers=headers)  # the same keep-alive connection
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"][0]["finish_reason"] == "length"
        assert conn.sock is sock  # not silently reopened by http.client
    finally:
        conn.close()


def test_a_surrogate_pair_is_one_character_and_accepted(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/completions", content=rb'{"prompt": "a\ud83d\ude00", "max_tokens": 2}',
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text


def test_an_error_quoting_a_lone_surrogate_still_renders() -> None:
    body = ErrorResponse(APIError(400, "unknown field 'a\ud800'", param="a\ud800").body(), 400).body
    assert json.loads(body)["error"]["param"] == "a\ud800"


# -- slow bodies -----------------------------------------------------------------------------------------------


def test_a_body_that_stalls_is_a_408_and_the_connection_closes(server: ServerProcess) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ".encode())
        data = b""
        while piece := sock.recv(65536):  # until the server closes the connection
            data += piece
    finally:
        sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "1 seconds" in error["message"], error


# -- prompts too long to tokenize --------------------------------------------------------------------------------


class _Vocab:
    def __init__(self, longest: int) -> None:
        self.longest = longest

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {"a": 0, "b" * self.longest: 1}


class _CountingTokenizer:
    """Tokenizes as one token per 4 characters, counting its calls."""

    chat_template = None

    def __init__(self, longest: int) -> None:
        self.hf = _Vocab(longest)
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return [1] * (len(text) // 4)


@pytest.mark.parametrize(("longest", "per_token"), [(100, 32), (5, 10)])  # real vocabularies have 100+ chars
def test_text_too_long_for_the_context_is_refused_before_tokenizing(longest: int, per_token: int) -> None:
    tokenizer = _CountingTokenizer(longest)
    model = ServedModel("m", "id", cast(Any, tokenizer), vocab_size=10, max_model_len=100, kv_cache_tokens=1000)
    with pytest.raises(APIError) as refused:
        parse_completion({"prompt": "x" * (per_token * 100 + 1), "max_tokens": 1}, model)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert f"at most {per_token * 100} characters" in refused.value.message
    assert tokenizer.calls == 0
    with pytest.raises(APIError) as counted:  # at the bound it is tokenized, then refused by its token count
        parse_completion({"prompt": "x" * (per_token * 100), "max_tokens": 1}, model)
    assert tokenizer.calls == 1 and "tokens" in counted.value.message


@pytest.fixture(scope="module")
def one_slot(snap: TinySnapshot) -> Iterator[ServeState]:
    """One request may be in flight (max_num_seqs 1, no queue)."""
    s = ready_state(snap, Limits(max_queue=0), max_num_seqs=1, max_model_len=64)
    yield s
    s.shutdown()


def test_token_ids_past_the_context_are_refused_before_each_is_checked(one_slot: ServeState) -> None:
    with TestClient(create_app(one_slot)) as c:
        r = c.post("/v1/completions", json={"prompt": [5] * 65 + [-1]})
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text


def test_tokenizing_runs_off_the_event_loop_and_holds_a_queue_slot(one_slot: ServeState,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert one_slot.service is not None and one_slot.service.model.tokenizer is not None
    tokenizer = one_slot.service.model.tokenizer
    entered, release = threading.Event(), threading.Event()
    released_in_time: list[bool] = []
    encode = tokenizer.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        entered.set()
        released_in_time.append(release.wait(timeout=30))  # on the event loop this would hold up the test below
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    replies: list[httpx.Response] = []
    with TestClient(create_app(one_slot)) as c:
        worker = threading.Thread(target=lambda: replies.append(
            c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2})))
        worker.start()
        try:
            assert entered.wait(timeout=30)
            health = c.get("/health")  # answered while the prompt is still being tokenized
            full = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        finally:
            release.set()
            worker.join(timeout=60)
    assert released_in_time == [True], "the tokenizer held up the event loop"
    assert health.status_code == 200
    assert full.status_code == 429, full.text  # the request being tokenized holds the only slot
    assert replies[0].status_code == 200, replies[0].text
    assert one_slot.service.in_flight == 0


# -- SIGTERM after the grace period ------------------------------------------------------------------------------


def test_requests_still_running_when_the_grace_period_ends_get_an_error_and_the_exit_is_quiet(
        snap: TinySnapshot) -> None:
    s = ServerProcess(snap, "--num-kv-blocks", "256", "--max-model-len", "1024", "--max-num-seqs", "1",
                      "--grace-seconds", "0")
    try:
        s.wait_for("ready")
        stream = _request(s.port, {"prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                                   "logprobs": 20})
        data = b""
        while b"data: " not in data:
            data += stream.recv(4096)
        queued = _request(s.port, {"prompt": "Twice", "max_tokens": 4})  # waits behind the stream
        _wait_for_waiting(s, 1)  # accepted, so the listener closing at SIGTERM cannot reset it
        # The stream's client reads nothing more until the cut, so the server cannot have sent it all by then.
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not any(e.get("event") == "grace_period_over" for e in s.events) and time.monotonic() < deadline:
            time.sleep(0.01)
        last = json.loads(_read_all(stream, data).rsplit(b"data: ", 1)[1].split(b"\n\n")[0])
        assert last["error"]["code"] == "server_shutting_down", last
        head, _, body = _read_all(queued, b"").partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"server_shutting_down" in body, head + body
        assert s.proc.wait(timeout=30) == 0
        stderr = s.proc.stderr.read()  # type: ignore[union-attr]
        assert "Traceback" not in stderr and "Cancel" not in stderr, stderr
        assert s.events[-1]["event"] == "stopped"
    finally:
        s.stop()


def _wait_for_waiting(server: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
        waiting = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("warmstart:num_requests_waiting{")]
        if waiting and waiting[0] >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"no {count} requests waiting in the engine")


def _request(port: int, body: dict[str, Any]) -> socket.socket:
    """A request on a raw socket whose receive buffer is small, so that a client not reading holds up the server."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _read_all(sock: socket.socket, data: bytes) -> bytes:
    with sock:
        while piece := sock.recv(65536):
            data += piece
    return data
