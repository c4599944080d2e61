"""`warmstart serve` as a real process on 127.0.0.1: readiness, auth, streaming, bad input over the wire,
client disconnects freeing KV blocks, concurrent clients, SIGTERM draining, a snapshot that does not load,
and `warmstart demo` end to end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cli import WARMSTART
from tests.support.serving import (
    AUTH,
    KEY,
    REF,
    REPO,
    START_TIMEOUT,
    SYSTEM_TEXT,
    ServerProcess,
    TinySnapshot,
    build_tiny_snapshot,
    error_of,
)

POOL_BLOCKS = 100_000


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="module")
def server(snap: TinySnapshot) -> Iterator[tuple[ServerProcess, list[int]]]:
    """A server, and the /health statuses seen from the moment it listened until it was ready."""
    # 100,000 KV blocks of this model are 2.4 GB: a pool that start-up touched page by page would show in RSS.
    s = ServerProcess(snap, "--num-kv-blocks", str(POOL_BLOCKS), "--max-model-len", "512", "--max-num-seqs", "32",
                      "--max-body-bytes", "65536")
    seen = []
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        status = httpx.get(s.url + "/health").status_code
        seen.append(status)
        if status == 200:
            break
        time.sleep(0.01)
    yield s, seen
    assert s.stop() == 0


@pytest.fixture
def http(server: tuple[ServerProcess, list[int]]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, headers=AUTH, timeout=60) as client:
        yield client


def metric(client: httpx.Client, name: str) -> float:
    """The sum of the metric's samples over all their labels."""
    values = [float(line.split()[-1]) for line in client.get("/metrics").text.splitlines()
              if line.startswith((f"warmstart:{name}{{", f"warmstart:{name} "))]
    assert values, f"no metric {name}"
    return sum(values)


def sse_data(raw: bytes) -> list[str]:
    return [line[len(b"data: "):].decode() for line in raw.split(b"\n") if line.startswith(b"data: ")]


def open_stream(port: int, body: dict[str, Any], path: str = "/v1/completions") -> socket.socket:
    """A streaming request on a raw socket, so that the test decides exactly when the client goes away."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_until(sock: socket.socket, data: bytes, done: Any) -> bytes:
    while not done(data):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


# -- readiness and the timeline ---------------------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(server: tuple[ServerProcess, list[int]], http: httpx.Client,
                                              snap: TinySnapshot) -> None:
    s, seen = server
    assert seen[0] == 503 and seen[-1] == 200 and set(seen) == {503, 200}
    status = http.get("/status").json()
    assert status["status"] == "ready" and status["snapshot_id"] == snap.id
    assert [p["name"] for p in status["prefixes"]] == ["assistant", "doc"]
    phases = status["phases"]
    order = ["process_start", "imports", "listening", "runtime_imports", "manifest", "blobs", "mapped", "ready"]
    assert [p for p in phases if p in order] == order
    assert all(phases[a] <= phases[b] for a, b in zip(order, order[1:], strict=False))
    # imports before listening stay light: torch only comes in the loading thread
    assert phases["listening"] < phases["runtime_imports"]
    logged = [e["phase"] for e in s.events if e.get("event") == "cold_start"]
    assert logged[: len(order) - 1] == order[1:] and len(logged) == len(set(logged))
    ready = next(e for e in s.events if e.get("phase") == "ready")
    assert ready["snapshot_id"] == snap.id and ready["url"] == s.url
    assert status["engine"]["num_kv_blocks"] == POOL_BLOCKS
    rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{s.proc.pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
    assert rss_kib < 1_000_000  # the 2.4 GB pool is allocated, not touched


# -- auth -------------------------------------------------------------------------------------------------------


def test_every_route_but_health_needs_the_key(server: tuple[ServerProcess, list[int]]) -> None:
    url = server[0].url
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/status", "/metrics", "/v1/models"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(url + path, headers=AUTH).status_code == 200
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"


# -- streaming and bad input ------------------------------------------------------------------------------------


def test_streaming_chat_hits_the_system_prefix(http: httpx.Client, snap: TinySnapshot) -> None:
    body = {"model": REF, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 12,
            "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": "Hello!"}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) >= 3  # streamed, not one blob
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens_details"]["cached_tokens"] == snap.cached_tokens["assistant"] > 0
    status = http.get("/status").json()["phases"]
    assert status["ready"] <= status["first_request"] <= status["first_token"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b'{"prompt": "x", ', 400, "not valid JSON"),
        (json.dumps({"prompt": list(range(3, 603))}).encode(), 400, "600 tokens"),
        (json.dumps({"prompt": "x", "prefix": "handbook"}).encode(), 400, "assistant, doc"),
        (json.dumps({"prompt": "x" * 100_000}).encode(), 413, "65536"),
        (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    ],
)
def test_bad_input_over_the_wire(http: httpx.Client, body: bytes, status: int, words: str) -> None:
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert words in error_of(r)["message"]


# -- disconnects, concurrency -----------------------------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server: tuple[ServerProcess, list[int]],
                                                                http: httpx.Client) -> None:
    idle_usage = metric(http, "kv_cache_usage_perc")  # the snapshot's pinned prefix blocks
    generated_before = metric(http, "generation_tokens_total")
    sock = open_stream(server[0].port, {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                                        "stream": True})
    read_until(sock, b"", lambda d: d.count(b"data: ") >= 3)
    assert metric(http, "num_requests_running") == 1 and metric(http, "kv_cache_usage_perc") > idle_usage
    sock.close()
    deadline = time.monotonic() + 10
    while metric(http, "num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(http, "num_requests_running") == 0
    assert metric(http, "kv_cache_usage_perc") == idle_usage
    assert metric(http, "generation_tokens_total") - generated_before < 400  # aborted, not run to the end


def test_two_dozen_concurrent_clients(server: tuple[ServerProcess, list[int]], http: httpx.Client) -> None:
    successes_before = metric(http, "request_success_total")

    async def one(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        body = {"model": REF, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": f"Q{i % 4}"}]}
        if i % 2:
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                data = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert data[-1] == "[DONE]"
            text = "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in data[:-1])
            return {"i": i, "text": text}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 10
        return {"i": i, "text": out["choices"][0]["message"]["content"]}

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server[0].url, headers=AUTH, timeout=120) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(24))))

    results = asyncio.run(main())
    assert len(results) == 24
    assert metric(http, "request_success_total") - successes_before == 24
    assert metric(http, "num_requests_running") == 0


# -- shutdown and failure ---------------------------------------------------------------------------------------


def test_sigterm_drains_in_flight_requests_then_exits_0(snap: TinySnapshot) -> None:
    s = ServerProcess(snap, "--num-kv-blocks", "96", "--max-model-len", "512", "--max-num-seqs", "1")
    try:
        s.wait_for("ready")
        streams = [open_stream(s.port, {"prompt": f"Story {i}", "max_tokens": 400, "ignore_eos": True,
                                        "stream": True}) for i in range(2)]  # the second waits behind the first
        first = read_until(streams[0], b"", lambda d: d.count(b"data: ") >= 2)
        s.proc.send_signal(signal.SIGTERM)
        assert refused_within(s.port, 5.0) and s.proc.poll() is None  # stopped accepting, still draining
        for sock, start in zip(streams, [first, b""], strict=True):
            data = sse_data(read_until(sock, start, lambda d: b"data: [DONE]" in d))
            sock.close()
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=30) == 0
        assert s.events[-1]["event"] == "stopped"
    finally:
        s.stop()


def refused_within(port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        time.sleep(0.02)
    return False


def test_a_snapshot_that_cannot_load_ends_the_process_with_one_sentence(snap: TinySnapshot) -> None:
    proc = subprocess.run([*WARMSTART, "serve", "nosuchref", "--store", str(snap.store),
                           "--cache", str(snap.cache), "--port", "0"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1
    assert proc.stderr.startswith("warmstart: error: no snapshot or ref 'nosuchref'") and "Traceback" not in proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert events[-1]["event"] == "error" and "nosuchref" in events[-1]["message"]


def test_demo_builds_serves_hits_the_prefix_and_streams(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "system.txt").write_text(SYSTEM_TEXT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WARMSTART_STORE": str(tmp_path / "store"),
           "WARMSTART_CACHE": str(tmp_path / "cache")}
    env.pop("WARMSTART_API_KEY", None)
    proc = subprocess.run([*WARMSTART, "demo", "--model-dir", str(tiny_model_dir("llama")),
                           "--system-file", str(tmp_path / "system.txt"), "--dtype", "float32", "--port", "0",
                           "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["server_exit_code"] == 0
    usage = result["chat"]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32
    assert len(result["stream_chunks"]) >= 2
    phases = result["status"]["phases"]
    assert phases["listening"] < phases["ready"] <= phases["first_token"]
