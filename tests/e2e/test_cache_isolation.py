"""Issue 40, 3, on real servers: a second user who guesses another's prompt must not learn it from cached_tokens.
vLLM's cache_salt puts a request's KV chain apart (same salt: shared; another or none: not), and
`serve --tenant-header NAME` puts each tenant's requests in a chain of their own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.serving import (
    AUTH,
    SYSTEM_TEXT,
    ServerProcess,
    TinySnapshot,
    build_tiny_snapshot,
    error_of,
    ready_side_by_side,
)

TENANT = "X-Tenant"


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:  # type: ignore[no-untyped-def]
    snap: TinySnapshot = build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("isolation"))
    started = {"shared": ServerProcess(snap), "tenants": ServerProcess(snap, "--tenant-header", TENANT)}
    with ready_side_by_side(started) as servers:
        yield servers


def secret_prompt() -> list[dict[str, str]]:  # long enough for several whole KV blocks, new each test
    return [{"role": "user", "content": f"My account number is {uuid.uuid4().hex} and my PIN is 4711, remember it."}]


def cached(server: ServerProcess, messages: list[dict[str, str]], headers: dict[str, str] | None = None,
           **fields: Any) -> int:
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={**AUTH, **(headers or {})}, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_cache_salt_keeps_chains_apart(servers: dict[str, ServerProcess]) -> None:
    server, secret = servers["shared"], secret_prompt()
    assert cached(server, secret, cache_salt="alice") == 0
    assert cached(server, secret, cache_salt="alice") > 0  # the same salt shares
    assert cached(server, secret, cache_salt="mallory") == 0  # another salt learns nothing
    assert cached(server, secret) == 0  # nor does an unsalted request
    assert cached(server, secret) > 0  # which has a chain of its own
    bad = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                     json={"model": "tiny", "messages": secret, "cache_salt": ""})  # fmt: skip
    assert bad.status_code == 400 and error_of(bad)["param"] == "cache_salt"


def test_each_tenant_has_a_cache_of_its_own(servers: dict[str, ServerProcess]) -> None:
    server, secret = servers["tenants"], secret_prompt()
    alice, mallory = {TENANT: "alice"}, {TENANT: "mallory"}
    assert cached(server, secret, alice) == 0
    assert cached(server, secret, alice) > 0
    assert cached(server, secret, mallory) == 0
    assert cached(server, secret, alice, cache_salt="x") == 0  # a salt splits a tenant's chain further
    missing = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                         json={"model": "tiny", "messages": secret})  # fmt: skip
    assert missing.status_code == 400 and TENANT in error_of(missing)["message"]
    # the snapshot's system prefix is shared on the default server, a tenant's own here (computed once each)
    system = [{"role": "system", "content": SYSTEM_TEXT}, *secret_prompt()]
    assert cached(servers["shared"], system) > 0
    assert cached(server, system, {TENANT: "carol"}) == 0
    assert cached(server, [system[0], *secret_prompt()], {TENANT: "carol"}) > 0
