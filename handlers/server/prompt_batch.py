"""A /v1/completions request with several prompts: one engine request per prompt, run together, their choices
indexed per prompt (prompt i's choices come at i * n + j, as vLLM numbers them) and their usage summed; streamed,
the chunks of all prompts interleave as they come, and one [DONE] ends them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from warmstart.handlers.openai.replies import SSE_DONE, sse
from warmstart.handlers.openai.requests import bad
from warmstart.handlers.server.service import EventStream


def split_prompts(body: Any) -> list[dict[str, Any]] | None:
    """The one-prompt bodies of a request whose prompt is a list of prompts; None for a single prompt."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, list) or len(prompt) < 2 or not any(isinstance(p, str | list) for p in prompt):
        return None  # one prompt, as text or token ids (a list of one is that one)
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise bad("prompt must be a string, an array of token ids, or an array of prompts that are all strings or "
                  "all arrays of token ids", "prompt")
    return [{**body, "prompt": p} for p in prompt]


async def serve_prompts(bodies: list[dict[str, Any]], respond: Callable[[dict[str, Any], Receive], Awaitable[Response]],
                        receive: Receive) -> Response:
    """Serve each body with ``respond`` at once; merge their replies into one. If one fails (a 4xx), the others
    are cancelled and that error is the reply."""
    shared = _SharedReceive(receive)
    tasks = [asyncio.ensure_future(respond(body, shared)) for body in bodies]
    try:
        replies = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for reply in done:
            if isinstance(reply, EventStream):
                await reply.run.close()
        raise
    finally:
        shared.stop()
    n = bodies[0].get("n")
    per_prompt = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    streams = [r for r in replies if isinstance(r, EventStream)]
    if streams:
        return MergedStream(streams, per_prompt)
    wholes = [json.loads(bytes(r.body)) for r in replies]
    choices = [{**c, "index": i * per_prompt + c["index"]} for i, w in enumerate(wholes) for c in w["choices"]]
    return JSONResponse({**wholes[0], "choices": choices, "usage": _sum_usage([w["usage"] for w in wholes])})


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}


class _SharedReceive:
    """One watcher of the client's connection for all the prompts' requests: ASGI's receive is not meant to be
    awaited by several tasks at once."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = asyncio.Event()
        self.watcher: asyncio.Task[None] | None = None

    async def __call__(self) -> Message:
        if self.watcher is None:
            self.watcher = asyncio.ensure_future(self._watch())
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _watch(self) -> None:
        message: Message = {}
        while message.get("type") != "http.disconnect":
            message = await self.receive()
        self.gone.set()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()


class MergedStream(StreamingResponse):
    """The prompts' SSE streams as one: chunks as they come, choice indexes per prompt, one usage chunk (when
    asked for) and one [DONE] at the end; every prompt's request is closed whatever happens."""

    def __init__(self, streams: list[EventStream], per_prompt: int) -> None:
        self.streams = streams
        self.per_prompt = per_prompt
        super().__init__(self._events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[bytes]:
        pending = {asyncio.ensure_future(_next(s.body_iterator)): i for i, s in enumerate(self.streams)}
        usages: list[dict[str, Any]] = []
        last: dict[str, Any] = {}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    raw = fut.result()
                    if raw is None:
                        continue
                    pending[asyncio.ensure_future(_next(self.streams[i].body_iterator))] = i
                    if raw == SSE_DONE:
                        continue
                    if not raw.startswith(b"data: {"):
                        yield raw  # a ping
                        continue
                    chunk = json.loads(raw[6:])
                    if chunk.get("choices") == [] and chunk.get("usage"):
                        usages.append(chunk["usage"])
                        last = chunk
                        continue
                    for c in chunk.get("choices", []):
                        c["index"] = i * self.per_prompt + c["index"]
                    yield sse(chunk)
        finally:
            for fut in pending:
                fut.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if usages:
            yield sse({**last, "usage": _sum_usage(usages)})
        yield SSE_DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                await s.run.close()


async def _next(chunks: Any) -> Any:
    """The next item of an async iterator, or None at its end."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None
