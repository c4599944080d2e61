"""A caller cancelled while its command waits for the engine's loop (a client that went away while its request
was being added) leaves the engine running: the loop skips the cancelled command."""

from __future__ import annotations

import asyncio
import pathlib
import threading

from tests.support.async_engine import GREEDY, ModelDir, collect, idle_stats, run_with
from warmstart.runtime import AsyncLLM, SamplingParams


def test_a_request_cancelled_before_the_loop_adds_it_leaves_the_engine_alive(tiny_model_dir: ModelDir) -> None:
    llama_dir: pathlib.Path = tiny_model_dir("llama")
    release = threading.Event()

    async def body(llm: AsyncLLM) -> tuple[bool, int, int]:
        held = llm._submit(lambda: release.wait(30))  # the loop is busy with this until released
        stream = llm.generate([5, 6, 7], SamplingParams(max_tokens=4), "gone")
        adding = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)  # its add command is queued behind the held one
        adding.cancel()
        await asyncio.gather(adding, return_exceptions=True)
        release.set()
        await asyncio.wrap_future(held)
        outs = await collect(llm, [5, 6, 7], GREEDY)
        stats = await idle_stats(llm)
        return llm.is_alive, len(outs[-1].token_ids), stats.num_running

    alive, tokens, running = run_with(llama_dir, body)
    assert alive and tokens == GREEDY.max_tokens and running == 0
