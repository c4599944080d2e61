"""Issue 40, item 1: what a client may hold of a real `warmstart serve` before its request is known. A header
flood (no key needed) gets 431 and the connection closed after about --max-header-bytes, and the server does not
grow; a connection past --max-connections gets 503 before it is read. Attacks are bounded in bytes and time."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.serving import ServerProcess, TinySnapshot, build_tiny_snapshot

FLOOD_BYTES = 8 << 20  # per connection: a server that keeps it all grows by 4 x 8 MiB
PIECE = 16 << 10


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("http-limits"))


@pytest.fixture(scope="module")
def server(snap: TinySnapshot) -> Iterator[ServerProcess]:
    proc = ServerProcess(snap, "--max-connections", "8")
    try:
        proc.wait_for("ready")
        yield proc
    finally:
        proc.stop()


def address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def rss_bytes(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024


def flood(server: ServerProcess, piece: bytes) -> tuple[int, bytes]:
    """Send a request line, then ``piece`` over and over as more header bytes, until FLOOD_BYTES or the server
    closes; returns (bytes sent, what the server answered)."""
    sent = 0
    with socket.create_connection(address(server), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while sent < FLOOD_BYTES and not select.select([s], [], [], 0)[0]:  # until the server says something
            s.sendall(piece)
            sent += len(piece)
        return sent, s.recv(4096) if select.select([s], [], [], 5)[0] else b""


@pytest.mark.parametrize("shape", ["one long header", "many headers"])
def test_a_header_flood_gets_431_and_the_server_does_not_grow(server: ServerProcess, shape: str) -> None:
    piece = b"a" * PIECE if shape == "one long header" else b"X-Flood: 0123456789abcdef\r\n" * (PIECE // 27)
    if shape == "one long header":
        piece = b"X-Long: " + piece[8:]  # one header whose value never ends
    before = rss_bytes(server.proc.pid)
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:  # four at once, as the attack
        results = list(pool.map(lambda _: flood(server, piece), range(4)))
    for sent, answer in results:
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
        assert sent < FLOOD_BYTES  # cut off, not read to the end
    assert time.monotonic() - started < 30
    assert rss_bytes(server.proc.pid) - before < 16 << 20  # a server keeping the floods grows by over 32 MiB
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_headers_within_the_limit_are_served(server: ServerProcess) -> None:
    big = {f"x-h{i}": "v" * 1000 for i in range(50)}  # ~50 KiB of headers, under 64 KiB
    assert httpx.get(server.url + "/health", headers=big, timeout=10).status_code == 200


def test_a_connection_past_the_limit_gets_503_before_it_is_read(server: ServerProcess) -> None:
    held = [socket.create_connection(address(server), timeout=10) for _ in range(8)]
    try:
        time.sleep(0.2)  # the server has taken them all
        with socket.create_connection(address(server), timeout=10) as extra:
            answer = extra.recv(4096)  # nothing sent: the answer comes at once
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer.lower(), answer[:120]
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=10).status_code != 200:  # the held ones are gone
        assert time.monotonic() < deadline
        time.sleep(0.1)
