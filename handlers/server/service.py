"""One validated request on the engine: the in-flight limit, a whole reply or an SSE stream, the client going
away (its request aborted and its KV blocks freed at once), and the metrics and cold-start marks it leaves."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from warmstart.handlers.openai.replies import Reply
from warmstart.handlers.openai.requests import APIError, Generation, ServedModel, bad
from warmstart.handlers.server.metrics import Metrics
from warmstart.handlers.server.middleware import record_usage
from warmstart.runtime.timeline import Timeline

if TYPE_CHECKING:
    from warmstart.runtime.async_engine import AsyncLLM
    from warmstart.runtime.outputs import RequestOutput

T = TypeVar("T")

SSE_PING = b": ping\n\n"  # an SSE comment: clients skip it, proxies and load balancers see the stream alive


class ReplyFormat(Protocol):
    """How one request's outputs become its reply: the whole body, or a stream's bytes (openai/replies.py's Reply
    for chat and completions, openai/responses.py's ResponsesReply for the Responses API)."""

    def whole(self, outs: list[RequestOutput]) -> dict[str, Any]: ...
    def opening(self) -> list[bytes]: ...
    def delta(self, out: RequestOutput) -> list[bytes]: ...
    def closing(self, last: RequestOutput) -> list[bytes]: ...
    def error(self, body: dict[str, Any]) -> bytes: ...


ReplyFor = Callable[[Generation, ServedModel, str], ReplyFormat]  # (request, model, request id) -> its reply


class ClientGone(Exception):
    """The client disconnected before its reply was ready; its request has been aborted."""


def engine_stopped(e: Exception) -> APIError:
    return APIError(503, f"the engine has stopped ({e}); this instance must be restarted")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and this request did not finish within its grace period "
                    "(--grace-seconds); send it again", code="server_shutting_down")


class Service:
    """The ready engine and what serving it needs; one per process."""

    def __init__(self, llm: AsyncLLM, model: ServedModel, metrics: Metrics, timeline: Timeline,
                 max_running: int, max_queue: int, ping_s: float = 15.0) -> None:
        self.llm = llm
        self.model = model
        self.metrics = metrics
        self.timeline = timeline
        self.max_running = max_running
        self.max_queue = max_queue
        self.ping_s = ping_s  # a stream idle this long gets an SSE comment, so proxies keep it open
        self.in_flight = 0  # requests being tokenized, waiting or running
        self.cut = False  # set once a shutdown's grace period is over: what still runs ends with an error
        # Tokenizing releases the GIL there (see runtime.tokenizer), so a long prompt stalls no stream.
        self.tokenizing = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                             thread_name_prefix="warmstart-tokenize")

    async def respond(self, prepare: Callable[[], Generation], receive: Receive,
                      reply_for: ReplyFor = Reply) -> Response:  # fmt: skip
        """Serve the request ``prepare`` validates and tokenizes (in a thread, holding a slot meanwhile), its reply
        made by ``reply_for``."""
        from warmstart.runtime.async_engine import EngineDeadError

        if self.in_flight >= self.max_running + self.max_queue:
            raise APIError(429, f"the server is full: {self.in_flight} requests in flight ({self.max_running} run "
                           f"at once, {self.max_queue} may wait); retry in a moment", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.in_flight += 1
        try:
            gen = await asyncio.get_running_loop().run_in_executor(self.tokenizing, prepare)
        except BaseException:
            self.in_flight -= 1
            raise
        self.metrics.count_ignored(gen.ignored_fields)
        run = _Run(self, gen, f"{'chatcmpl' if gen.chat else 'cmpl'}-{uuid.uuid4().hex}")
        try:
            # A stream whose first token is slow to come (queued behind others) starts without it, and pings.
            first = await until_disconnected(run.poll(self.ping_s) if gen.stream else run.next(), receive)
        except BaseException as e:
            await run.close()
            if isinstance(e, ValueError):  # the engine's own checks, should ours have missed one
                raise bad(str(e)) from None
            if isinstance(e, EngineDeadError):
                raise self.unavailable(e) from None
            raise
        reply = reply_for(gen, self.model, run.request_id)
        if gen.stream:
            return EventStream(run, reply, first)
        assert first is not None
        try:
            last = await until_disconnected(run.rest(first), receive)
        except EngineDeadError as e:
            raise self.unavailable(e) from None
        finally:
            await run.close()
        return JSONResponse(reply.whole(last))

    def unavailable(self, e: Exception) -> APIError:
        return shutting_down() if self.cut else engine_stopped(e)

    async def cut_in_flight(self) -> None:
        """End every request still in flight with an error (a 503, or an SSE error event once streaming):
        stopping the engine ends each engine stream, and `cut` ends a stream whose outputs are already queued."""
        self.cut = True
        await asyncio.to_thread(self.llm.shutdown)


class _Run:
    """One request in flight: its engine stream, the slot it holds (taken by Service.respond), the timings it
    reports when closed."""

    def __init__(self, service: Service, gen: Generation, request_id: str) -> None:
        self.service = service
        self.request_id = request_id
        self.stream = cast(AsyncGenerator["RequestOutput", None],
                           service.llm.generate(gen.prompt_ids, gen.params, request_id, gen.adapter))
        self.last: RequestOutput | None = None
        self.num_choices = gen.params.n
        self.num_finished = 0  # choices
        self.last_at: float | None = None
        self.closed = False
        self.pending: asyncio.Future[RequestOutput] | None = None  # the next output, while poll waits for it

    async def next(self) -> RequestOutput:
        if self.service.cut:
            from warmstart.runtime.async_engine import EngineDeadError

            raise EngineDeadError("the server is shutting down")
        out = await anext(self.stream)
        self.num_finished += out.finished
        now = time.monotonic()
        if out.new_token_ids:
            if self.last_at is None:
                first = out.timestamps.first_token if out.timestamps else None
                self.service.timeline.mark("first_token", at=first or now)
            else:
                self.service.metrics.observe_inter_token(now - self.last_at, len(out.new_token_ids))
            self.last_at = now
        self.last = out
        return out

    async def poll(self, timeout: float) -> RequestOutput | None:
        """The next output, or None if it has not come within ``timeout`` seconds (it is still awaited)."""
        if self.pending is None:
            self.pending = asyncio.ensure_future(self.next())
        done, _ = await asyncio.wait({self.pending}, timeout=timeout)
        if not done:
            return None
        task, self.pending = self.pending, None
        return task.result()

    async def rest(self, out: RequestOutput) -> list[RequestOutput]:
        """Every choice's final output (one per index: params.n of them), from ``out`` on."""
        finals: dict[int, RequestOutput] = {}
        while True:
            if out.finished:
                finals[out.index] = out
            if len(finals) == self.num_choices:
                return [finals[i] for i in sorted(finals)]
            out = await self.next()

    async def close(self) -> None:
        """Give back the slot and abort the request unless it finished; safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        self.service.in_flight -= 1
        if self.pending is not None:  # the stream cannot be closed while a step of it runs
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)
        await self.stream.aclose()
        out = self.last
        if out is not None:
            record_usage(out)
        ts = out.timestamps if out else None
        if out is None or ts is None:
            return
        ttft = ts.first_token - ts.arrival if ts.first_token is not None else None
        queued = ts.scheduled - ts.arrival if ts.scheduled is not None else None
        e2e = (ts.finished or time.monotonic()) - ts.arrival
        self.service.metrics.observe_request(ttft, queued, e2e, out.finish_reason if out.finished else None)


class EventStream(StreamingResponse):
    """The reply's stream as tokens arrive (chat's SSE chunks then `data: [DONE]`, or the Responses events).
    Starlette cancels the stream when the client goes away; the request is then aborted, and closed here whatever
    happened."""

    def __init__(self, run: _Run, reply: ReplyFormat, first: RequestOutput | None) -> None:
        self.run = run
        self.reply = reply
        self.first = first
        super().__init__(self._events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[bytes]:
        from warmstart.runtime.async_engine import EngineDeadError

        for opening in self.reply.opening():
            yield opening
        out = self.first
        while True:
            while out is None:
                try:
                    out = await self.run.poll(self.run.service.ping_s)
                except EngineDeadError as e:  # the status line is long gone: say it in the stream
                    yield self.reply.error(self.run.service.unavailable(e).body())
                    return
                except ValueError as e:  # the engine's own checks, on a stream that started before its first token
                    yield self.reply.error(bad(str(e)).body())
                    return
                if out is None:
                    yield SSE_PING
            for delta in self.reply.delta(out):
                yield delta
            if self.run.num_finished == self.run.num_choices:
                break
            out = None
        for closing in self.reply.closing(out):
            yield closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.run.close()


async def until_disconnected(awaitable: Awaitable[T], receive: Receive) -> T:
    """Await ``awaitable``, unless the client disconnects first: then cancel it and raise ClientGone.

    The request body has been read by then, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(receive: Receive) -> None:
    message: dict[str, Any] = {}
    while message.get("type") != "http.disconnect":
        message = dict(await receive())


async def on_engine(llm: AsyncLLM, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the engine's step-loop thread, between steps: the engine is not thread-safe."""
    return await llm._call(fn)
