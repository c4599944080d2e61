"""The Starlette app: routes, the optional API key, the body limit, and OpenAI-style bodies for every error.

Routes: GET /health (503 until the engine is ready, then 200), GET /status (the cold-start timeline and
what is served), GET /metrics (Prometheus), GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses, POST /v1/embeddings, POST /tokenize, POST /detokenize, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (handlers/server/lora_routes.py); and SageMaker's container contract: GET /ping (as
/health) and POST /invocations (a chat completion). Every response has an X-Request-Id (see handlers.server.middleware).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from warmstart.handlers.openai.requests import APIError, Generation, ServedModel, bad, parse_chat, parse_completion
from warmstart.handlers.openai.responses import ResponsesCall, ResponsesReply, to_chat
from warmstart.handlers.server import embeddings_api, lora_routes, tokenize_api
from warmstart.handlers.server.metrics import CONTENT_TYPE
from warmstart.handlers.server.middleware import RequestContext, add_cors
from warmstart.handlers.server.prompt_batch import serve_prompts, split_prompts
from warmstart.handlers.server.service import ClientGone
from warmstart.handlers.server.state import Limits, ServeState
from warmstart.handlers.server.timeline import print_json_line

if TYPE_CHECKING:
    from warmstart.runtime.outputs import EngineStats

Parser = Callable[[Any, ServedModel], Generation]


def create_app(state: ServeState) -> Starlette:
    async def health(request: Request) -> Response:
        if state.healthy:
            return JSONResponse({"status": "ready"})
        status = "engine_stopped" if state.service is not None else state.status  # loading or failed
        return JSONResponse({"status": status}, status_code=503)

    async def status(request: Request) -> Response:
        body = state.status_json()
        if state.healthy and state.service:
            stats = await state.service.llm.stats()
            body["speculative"] = speculative_status(stats, body.get("engine", {}))
            if stats.kv_tier is not None:
                body["kv_tier"] = {**body.get("kv_tier", {}), "counters": stats.kv_tier}
        return JSONResponse(body)

    async def metrics(request: Request) -> Response:
        stats = await state.service.llm.stats() if state.healthy and state.service else None
        lora = await lora_routes.lora_stats(state.service.llm) if stats is not None and state.service else None
        return Response(state.metrics.render(stats, lora), media_type=CONTENT_TYPE)

    async def models(request: Request) -> Response:
        entry: dict[str, Any] = {"id": state.model_name, "object": "model", "owned_by": "warmstart",
                                 "root": state.info.get("snapshot_id")}
        if state.service is not None:
            entry["created"] = state.service.model.created
            entry["max_model_len"] = state.service.model.max_model_len
        # Adapters as vLLM lists LoRA adapters: a model entry each, by its bare name, whose parent is the base.
        adapters = [{**entry, "id": a["name"], "parent": state.model_name,
                     "virtual_tokens": a["virtual_tokens"]} for a in state.info.get("adapters", [])]
        loras = [{**entry, "id": name, "parent": state.model_name} for name in state.loras]
        return JSONResponse({"object": "list", "data": [entry, *adapters, *loras]})

    async def generate(request: Request, parse: Parser, raw: bytes | None = None) -> Response:
        service = state.ready_service()
        state.timeline.mark("first_request")
        raw = await read_body(request, state.limits) if raw is None else raw
        tenant = _tenant(request, state.tenant_header)
        # Parsing and tokenizing run in a thread, counted against the queue limit meanwhile.
        return await service.respond(functools.partial(_parse_request, raw, parse, service.model, tenant),
                                     request.receive)

    async def completions(request: Request) -> Response:
        service = state.ready_service()
        raw = await read_body(request, state.limits)
        several = await asyncio.get_running_loop().run_in_executor(service.tokenizing,
                                                                   lambda: split_prompts(parse_json(raw)))
        if several is None:
            return await generate(request, parse_completion, raw)
        state.timeline.mark("first_request")
        tenant = _tenant(request, state.tenant_header)

        async def one(body: dict[str, Any], receive: Receive) -> Response:
            return await service.respond(lambda: _salted(parse_completion(body, service.model), tenant), receive)

        return await serve_prompts(several, one, request.receive)

    async def responses(request: Request) -> Response:
        service = state.ready_service()
        state.timeline.mark("first_request")
        raw = await read_body(request, state.limits)
        tenant = _tenant(request, state.tenant_header)
        calls: list[ResponsesCall] = []

        def prepare() -> Generation:
            calls.append(to_chat(parse_json(raw)))
            return _salted(parse_chat(calls[0].chat, service.model), tenant)

        return await service.respond(prepare, request.receive,
                                     lambda gen, model, _: ResponsesReply(calls[0], gen, model))

    def tokenizing(work: Callable[[Any, ServedModel], dict[str, Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            service = state.ready_service()
            raw = await read_body(request, state.limits)
            body = await asyncio.get_running_loop().run_in_executor(
                service.tokenizing, lambda: work(parse_json(raw), service.model))
            return JSONResponse(body)

        return endpoint

    async def chat(request: Request) -> Response:
        return await generate(request, parse_chat)

    async def embeddings(request: Request) -> Response:
        service = state.ready_service()
        raw = await read_body(request, state.limits)
        return JSONResponse(await embeddings_api.embeddings(service, parse_json(raw), state.embedding_pooling,
                                                            state.model_name))

    async def load_lora(request: Request) -> Response:
        return await lora_routes.load_lora_adapter(state, parse_json(await read_body(request, state.limits)))

    async def unload_lora(request: Request) -> Response:
        return await lora_routes.unload_lora_adapter(state, parse_json(await read_body(request, state.limits)))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
        Route("/tokenize", tokenizing(tokenize_api.tokenize), methods=["POST"]),
        Route("/detokenize", tokenizing(tokenize_api.detokenize), methods=["POST"]),
        Route("/ping", health, methods=["GET"]),
        Route("/invocations", chat, methods=["POST"]),
    ]
    handlers: dict[Any, Callable[[Request, Any], Awaitable[Response]]] = {
        APIError: _api_error,
        HTTPException: _http_error,
        ClientGone: _client_gone,
        Exception: _server_error,
    }
    app = Starlette(routes=routes, exception_handlers=handlers)
    # The last added runs first: request ids around everything, CORS preflights answered before the key check.
    if state.limits.api_key:
        app.add_middleware(BearerAuth, key=state.limits.api_key)
    add_cors(app, state.limits.allowed_origins)
    app.add_middleware(RequestContext, log=print_json_line if state.limits.access_log else None)
    return app


async def read_body(request: Request, limits: Limits) -> bytes:
    """The body, refusing more than ``limits.max_body_bytes`` bytes (413) before reading them where the length
    is declared, and as soon as they pass the limit where it is not; a body that has not all arrived within
    ``limits.body_timeout_s`` is a 408 (a client trickling bytes would otherwise hold its slot forever)."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"is {int(declared)} bytes", limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(f"is over {limit} bytes", limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} seconds "
                       f"({size} bytes came); send the whole body at once", code="request_timeout",
                       headers={"Connection": "close"}) from None
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """The body as JSON; a 400 saying what is wrong with it otherwise."""
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad("the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, integers too long to convert
        raise bad(f"the request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(raw):  # valid UTF-8 cannot hold a surrogate: only an escape can
        _refuse_lone_surrogates(body)
    return body


def _parse_request(raw: bytes, parse: Parser, model: ServedModel, tenant: str | None = None) -> Generation:
    return _salted(parse(parse_json(raw), model), tenant)


def _tenant(request: Request, header: str | None) -> str | None:
    """The tenant a request names in ``header`` (serve --tenant-header), whose prefix cache is its own."""
    if header is None:
        return None
    tenant = request.headers.get(header)
    if not tenant:
        raise bad(f"this server keeps each tenant's cached prompts apart and needs the header {header!r} naming "
                  "the tenant")
    return tenant


def _salted(gen: Generation, tenant: str | None) -> Generation:
    """The request's KV chain in its tenant's own: the tenant goes into its cache salt (with its cache_salt)."""
    if tenant is not None:
        gen.params.cache_salt = f"tenant:{tenant}\0{gen.params.cache_salt or ''}"
    return gen


# \ud800-\udfff: half of a surrogate pair, or a lone surrogate that no UTF-8 text (and no tokenizer) can hold.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(body: Any) -> None:
    """A 400 naming where the body holds a string (or a field name) with a lone UTF-16 surrogate, which json
    accepts but nothing downstream can encode. Iterative: the body may be nested as deep as json allowed."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        where = None
        if isinstance(value, str) and _has_lone_surrogate(value):
            where = _json_path(path)
        elif isinstance(value, dict):
            if any(_has_lone_surrogate(k) for k in value):
                where = f"a field name of {_json_path(path)}" if path else "a field name"
            stack.extend((v, (*path, k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))
        if where is not None:
            param = path[0] if path and isinstance(path[0], str) else None
            raise bad(f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                      "valid Unicode text; send characters outside the Basic Multilingual Plane as a surrogate pair "
                      "or as UTF-8", param, "invalid_unicode")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _json_path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part[:40]}" if out else part[:40]
    return out or "the body"


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"the request body {size}; this server accepts at most {limit} bytes",
                    code="request_too_large")


class ErrorResponse(JSONResponse):
    """An error body in ASCII JSON: it renders whatever text a message quotes from the request (a lone
    surrogate cannot be UTF-8), so an error never becomes a 500 that also drops the connection."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


class BearerAuth:
    """With an API key set, every route but /health (and /ping, its SageMaker name) needs `Authorization: Bearer
    <key>` (compared in constant time, so the time taken says nothing about the key)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/ping"):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        message = ("this server needs an API key: send the header 'Authorization: Bearer <key>'" if given is None
                   else "the API key is not valid (send 'Authorization: Bearer <key>')")
        error = APIError(401, message, code="invalid_api_key")
        await ErrorResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path}; see GET /v1/models, POST /v1/completions, POST /v1/chat/completions"
    elif exc.status_code == 405:
        message = f"{request.url.path} does not accept {request.method}"
    else:
        message = str(exc.detail)
    return ErrorResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code, headers=exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"


async def _server_error(request: Request, exc: Exception) -> Response:
    body = APIError(500, f"internal error ({type(exc).__name__}); this is a bug, the server log has the details")
    return ErrorResponse(body.body(), status_code=500)


def speculative_status(stats: EngineStats, engine: dict[str, Any]) -> dict[str, Any]:
    return {"method": engine.get("speculative"), "num_speculative_tokens": engine.get("num_speculative_tokens"),
            "num_drafts": stats.spec_num_drafts, "num_draft_tokens": stats.spec_num_draft_tokens,
            "num_accepted_tokens": stats.spec_num_accepted_tokens,
            "num_emitted_tokens": stats.spec_num_emitted_tokens, "acceptance_rate": stats.spec_acceptance_rate}
