"""Issue 22, item 1 over HTTP: a snapshot whose prefixes pin more KV blocks than one full-length sequence
needs. A real `warmstart serve` with --max-num-seqs 2 and the pool sized from memory serves a request as long
as the context and the requests behind it (the old pool, 2 sequences' worth with the pinned blocks inside
it, hung on it for good); an explicit pool too small for a request answers 400 at once and serves the next;
one too small for the pinned blocks refuses to start, naming the flag and a value that works. Also the cap
on stop_token_ids (item 8) as a 400."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from tests.support.serving import (
    AUTH,
    DOC_TEXT,
    REF,
    SYSTEM_TEXT,
    ServerProcess,
    TinySnapshot,
    build_tiny_snapshot,
    error_of,
)
from warmstart.handlers.server.app import create_app
from warmstart.handlers.server.state import Limits, ServeState, load_snapshot
from warmstart.handlers.server.timeline import cold_start_timeline
from warmstart.runtime.sampling_params import MAX_STOP_TOKEN_IDS

BLOCK = 16
CONTEXT = 512
LONG_SYSTEM = SYSTEM_TEXT * 3  # about 390 tokens each: together they pin more than CONTEXT / BLOCK blocks
LONG_DOC = DOC_TEXT * 3
COMPLETION = {"model": REF, "prompt": [5], "temperature": 0, "ignore_eos": True}

pytestmark = pytest.mark.timeout(120)  # before the fix these requests waited forever


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("admission"), LONG_SYSTEM, LONG_DOC)


@pytest.fixture(scope="module")
def pinned(snap: TinySnapshot) -> int:
    blocks = sum(snap.cached_tokens.values()) // BLOCK
    assert blocks > CONTEXT // BLOCK  # what made the old default pool (2 * 32 blocks) hang a full-length request
    return blocks


def chat_with_system(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Hi"}]
    return {"model": REF, "messages": messages, "temperature": 0, "ignore_eos": True, **extra}


def test_serve_with_pinned_prefixes_and_two_seqs_runs_a_full_context_request(snap: TinySnapshot, pinned: int) -> None:
    server = ServerProcess(snap, "--max-model-len", str(CONTEXT), "--max-num-seqs", "2")
    try:
        server.wait_for("ready")
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            assert http.get("/status").json()["engine"]["num_kv_blocks"] == 2 * CONTEXT // BLOCK + pinned
            full = http.post("/v1/completions", json={**COMPLETION, "max_tokens": CONTEXT - 1})
            assert full.status_code == 200, full.text
            assert full.json()["usage"]["completion_tokens"] == CONTEXT - 1
            chat = http.post("/v1/chat/completions", json=chat_with_system())  # the default max_tokens: the rest
            assert chat.status_code == 200, chat.text
            usage = chat.json()["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
            after = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 4})
            assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
            too_many = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 4,
                                                          "stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)})
            assert too_many.status_code == 400
            error = error_of(too_many)
            assert error["param"] == "stop_token_ids" and f"at most {MAX_STOP_TOKEN_IDS}" in error["message"]
            at_limit = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 4,
                                                          "stop_token_ids": [7] * MAX_STOP_TOKEN_IDS})
            assert at_limit.status_code == 200, at_limit.text
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def small_pool(snap: TinySnapshot, pinned: int) -> Iterator[TestClient]:
    """A pool with 8 blocks (128 tokens) beside the pinned ones."""
    state = ServeState(REF, REF, cold_start_timeline(), Limits())
    load_snapshot(state, str(snap.store), snap.cache, {"num_kv_blocks": pinned + 8, "max_model_len": CONTEXT})
    assert state.status == "ready", state.error
    with TestClient(create_app(state)) as client:
        yield client
    state.shutdown()


def test_request_that_can_never_fit_is_a_400_and_the_next_is_served(small_pool: TestClient, pinned: int) -> None:
    refused = small_pool.post("/v1/completions", json={**COMPLETION, "max_tokens": CONTEXT - 1})
    assert refused.status_code == 400
    message = error_of(refused)["message"]
    assert f"at most {8 * BLOCK - 1} tokens can follow this prompt" in message
    assert f"8 of its {pinned + 8} blocks" in message and "--num-kv-blocks" in message
    served = small_pool.post("/v1/completions", json={**COMPLETION, "max_tokens": 8 * BLOCK - 1})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 8 * BLOCK - 1


def test_chat_default_max_tokens_counts_the_shared_pinned_system_prefix(small_pool: TestClient) -> None:
    """The system prompt's pinned blocks are shared, so the default fills the context, not 8 blocks less it."""
    chat = small_pool.post("/v1/chat/completions", json=chat_with_system())
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
    assert usage["completion_tokens"] > 1


def test_pool_too_small_for_the_pinned_blocks_refuses_to_start_naming_the_flag(
    snap: TinySnapshot, pinned: int
) -> None:
    state = ServeState(REF, REF, cold_start_timeline(), Limits())
    load_snapshot(state, str(snap.store), snap.cache, {"num_kv_blocks": pinned, "max_model_len": CONTEXT})
    assert state.status == "failed"
    assert state.error is not None
    assert f"--num-kv-blocks) to at least {pinned + CONTEXT // BLOCK}" in state.error
