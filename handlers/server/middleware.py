"""What wraps every request: its X-Request-Id, one JSON access-log line, and CORS when origins are allowed.

The request id is the client's X-Request-Id when it is a sane token (so a trace can follow one request through a
proxy and this server), else a fresh one; it goes back on every response, errors and preflights included. The
access line has the method, path, status, duration, request id and token counts, never the prompt's text.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from warmstart.runtime.outputs import RequestOutput

REQUEST_ID_HEADER = b"x-request-id"
# Sane: what a tracer or proxy sends (uuids, hex, base64url, dotted or colon-separated ids), short enough to log.
_SANE_ID = re.compile(rb"[A-Za-z0-9._:+=/-]{1,128}")

# The token counts of the request now being served, for its access line; None outside a request.
_usage: ContextVar[dict[str, int] | None] = ContextVar("warmstart_request_usage", default=None)


def record_usage(out: RequestOutput) -> None:
    """Add what one engine request consumed and produced to the access line of the HTTP request serving it (a
    request with several prompts runs several)."""
    usage = _usage.get()
    if usage is not None:
        usage["prompt_tokens"] = usage.get("prompt_tokens", 0) + len(out.prompt_token_ids)
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + len(out.token_ids)


def request_id_of(scope: Scope) -> str | None:
    state = scope.get("state")
    return state.get("request_id") if isinstance(state, dict) else None


class RequestContext:
    """Gives each HTTP request an id (echoed in X-Request-Id) and, with ``log`` set, one access line when its
    response is done (or its handler failed)."""

    def __init__(self, app: ASGIApp, log: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), b"")
        request_id = given.decode() if _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.monotonic()
        status = 500  # unless a response starts: a handler that raised past every exception handler
        usage: dict[str, int] = {}
        token = _usage.set(usage)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _usage.reset(token)
            if self.log is not None:
                self.log({"event": "access", "method": scope["method"], "path": scope["path"], "status": status,
                          "duration_s": round(time.monotonic() - started, 4), "request_id": request_id, **usage})


def add_cors(app: Any, origins: tuple[str, ...]) -> None:
    """CORS for the browser origins given ("*" for any), as Starlette's middleware answers it; added after the
    API-key check so that it wraps it and preflights (which carry no credentials) are answered first."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"])
