"""AsyncLLM on a tiny model, for the tests that drive it: one engine per test, under a timeout."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from warmstart.runtime import AsyncLLM, EngineOptions, EngineStats, LLMEngine, RequestOutput, SamplingParams

ModelDir = Callable[[str], pathlib.Path]


T = TypeVar("T")


TIMEOUT = 60.0  # per test: a hang fails instead of blocking the suite


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def options(**kw: Any) -> EngineOptions:
    return EngineOptions(**{"dtype": "float32", "num_kv_blocks": 96, **kw})


def run_with(model_dir: pathlib.Path, body: Callable[[AsyncLLM], Awaitable[T]], **kw: Any) -> T:
    async def main() -> T:
        llm = AsyncLLM(LLMEngine.from_hf(model_dir, options(**kw)))
        try:
            return await asyncio.wait_for(body(llm), TIMEOUT)
        finally:
            llm.shutdown()

    return asyncio.run(main())


async def collect(llm: AsyncLLM, prompt: Any, params: SamplingParams, rid: str | None = None) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params, rid)]


async def idle_stats(llm: AsyncLLM, tries: int = 100) -> EngineStats:
    """Poll until nothing runs, waits or holds a block (an abort sent from a finalizer lands a bit later)."""
    for _ in range(tries):
        stats = await llm.stats()
        if stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine still busy: {stats}")
