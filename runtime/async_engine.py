"""The server's face: many coroutines submit, stream and abort; one thread runs the step loop.

The engine is touched only by its own thread. Coroutines send it commands through a queue and get
their outputs back through per-request asyncio queues, so the event loop never waits on a forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.input_processor import Prompt
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.outputs import EngineStats, RequestOutput
from warmstart.runtime.sampling_params import SamplingParams

Command = Callable[[], Any]


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error; the server should report unhealthy and restart."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Command, concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="warmstart-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_hf(cls, model_dir: str | Path, options: EngineOptions | None = None) -> AsyncLLM:
        return cls(LLMEngine.from_hf(model_dir, options))

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, adapter: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield an output each time the request gains tokens; the last one has ``finished`` set. With
        ``params.n`` > 1, each output is of choice ``index``, until every choice has finished.

        Leaving the iteration early (a client that went away) aborts the request and frees its blocks.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()

        def add() -> str:
            rid = self.engine.add_request(prompt, params, request_id, adapter)
            with self._lock:
                self._streams[rid] = (loop, outputs)
            return rid

        if params.structured_outputs is not None:
            # Compiled here, off the step loop (the first one also builds the grammar engine's view of the
            # vocabulary: 0.7 s for 49k tokens); the engine's own compile then finds it in the compiler's cache.
            spec = params.structured_outputs
            await asyncio.to_thread(lambda: self.engine.inputs.grammar_compiler().compile(spec))
        rid = await self._call(add)
        finished = False
        unfinished = params.n  # choices: each output says its index
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                unfinished -= item.finished
                finished = unfinished == 0
                yield item
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished and self.error is None:
                self._submit(lambda: self.engine.abort(rid))

    async def abort(self, request_id: str) -> None:
        out = await self._call(lambda: self.engine.abort(request_id))
        if out is not None:
            self._deliver([out])

    async def stats(self) -> EngineStats:
        return await self._call(self.engine.stats)  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        """Stop the step loop; requests still in flight end with EngineDeadError."""
        with self._lock:
            if self.error is None:
                self._commands.put(None)
        self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- engine thread --------------------------------------------------------------------------------

    async def _call(self, fn: Command) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _submit(self, fn: Command) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:  # after _stop has drained the queue nothing may be left in it
            if self.error is not None:
                future.set_exception(EngineDeadError(f"the engine stopped: {self.error}"))
            else:
                self._commands.put((fn, future))
        return future

    def _loop(self) -> None:
        idle_work = True  # start-up work left for later (decode graphs), done while no request runs
        try:
            while True:
                block = not self.engine.has_unfinished() and not idle_work
                while True:
                    try:
                        item = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    if item is None:
                        self._stop(RuntimeError("it was shut down"))
                        return
                    fn, future = item
                    if not future.set_running_or_notify_cancel():
                        continue  # its caller was cancelled (a client gone): nothing to do, nobody to tell
                    try:
                        future.set_result(fn())
                    except Exception as e:  # the caller's error (a bad request), not the engine's
                        future.set_exception(e)
                    block = False
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                elif idle_work:  # one piece at a time: a request that comes meanwhile waits for that piece only
                    idle_work = self.engine.idle_work()
        except BaseException as e:
            self._stop(e)
            raise

    def _stop(self, why: BaseException) -> None:
        """End every stream and queued call with EngineDeadError instead of leaving them waiting."""
        with self._lock:
            self.error = why
            dead = EngineDeadError(f"the engine stopped: {why}")
            for loop, q in self._streams.values():
                loop.call_soon_threadsafe(q.put_nowait, dead)
            while True:
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].set_exception(dead)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    loop, q = target
                    loop.call_soon_threadsafe(q.put_nowait, out)
