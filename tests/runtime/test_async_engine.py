"""AsyncLLM on a tiny model: concurrent streams, aborts (explicit, by leaving the loop, by cancelling),
errors that stay with their caller, timestamps and shutdown. Plain pytest: each test runs asyncio.run."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncGenerator
from typing import Any, cast

import pytest

from tests.support.async_engine import GREEDY, ModelDir, collect, idle_stats, options, run_with
from warmstart.runtime import (
    LLM,
    AsyncLLM,
    EngineDeadError,
    EngineStats,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)

LONG = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)  # aborted long before it ends


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: ModelDir) -> pathlib.Path:
    return tiny_model_dir("llama")


def prompts() -> list[list[int]]:
    return [[5 + (i * 53 + j * 17) % 900 for j in range(2 + 5 * i)] for i in range(8)]


def check_stream(outs: list[RequestOutput]) -> None:
    """Each output extends the last: new tokens and text concatenate to the totals; only the last is final."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    tokens: list[int] = []
    text = ""
    for out in outs:
        tokens += out.new_token_ids
        text += out.new_text
        assert out.token_ids == tokens
        assert out.text == text
    assert len({o.request_id for o in outs}) == 1


# -- streaming -------------------------------------------------------------------------------------------------


def test_concurrent_streams_are_consistent_and_match_llm_generate(llama_dir: pathlib.Path) -> None:
    ps = prompts()

    async def body(llm: AsyncLLM) -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(collect(llm, p, GREEDY) for p in ps)))

    streams = run_with(llama_dir, body)
    expected = LLM(LLMEngine.from_hf(llama_dir, options())).generate(ps, GREEDY)
    for outs, want in zip(streams, expected, strict=True):
        check_stream(outs)
        assert len(outs) == GREEDY.max_tokens  # streamed token by token, not in one final blob
        assert outs[-1].token_ids == want.token_ids
        assert outs[-1].finish_reason == "length"


def test_text_prompts_stream_text(llama_dir: pathlib.Path) -> None:
    async def body(llm: AsyncLLM) -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(collect(llm, p, GREEDY) for p in ["Once upon a time", "The cat"])))

    for outs in run_with(llama_dir, body):
        check_stream(outs)
        assert outs[-1].text and outs[-1].prompt_token_ids


# -- aborts -----------------------------------------------------------------------------------------------------


def test_abort_mid_stream_frees_blocks_at_once_and_ends_the_stream(llama_dir: pathlib.Path) -> None:
    async def body(llm: AsyncLLM) -> tuple[list[RequestOutput], EngineStats, EngineStats]:
        outs: list[RequestOutput] = []
        async for out in llm.generate(prompts()[3], LONG, "long"):
            outs.append(out)
            if len(outs) == 3:
                busy = await llm.stats()
                await llm.abort("long")
                after = await llm.stats()  # no polling: the abort freed everything before returning
        return outs, busy, after

    outs, busy, after = run_with(llama_dir, body)
    assert busy.num_kv_blocks_used > 0 and busy.num_running == 1
    assert after.num_kv_blocks_used == 0 and after.num_running == after.num_waiting == 0
    check_stream(outs)
    assert outs[-1].finish_reason == "abort"
    assert 3 <= len(outs[-1].token_ids) < LONG.max_tokens


def test_abort_leaves_other_requests_untouched(llama_dir: pathlib.Path) -> None:
    ps = prompts()

    async def body(llm: AsyncLLM) -> tuple[list[RequestOutput], list[list[RequestOutput]]]:
        async def aborter() -> list[RequestOutput]:
            outs: list[RequestOutput] = []
            async for out in llm.generate(ps[0], LONG, "victim"):
                outs.append(out)
                if len(outs) == 2:
                    await llm.abort("victim")
            return outs

        victim, *others = await asyncio.gather(aborter(), *(collect(llm, p, GREEDY) for p in ps[1:4]))
        await idle_stats(llm, tries=1)
        return victim, others

    victim, others = run_with(llama_dir, body)
    assert victim[-1].finish_reason == "abort"
    expected = LLM(LLMEngine.from_hf(llama_dir, options())).generate(prompts()[1:4], GREEDY)
    assert [o[-1].token_ids for o in others] == [e.token_ids for e in expected]


def test_abort_of_a_waiting_request(llama_dir: pathlib.Path) -> None:
    async def body(llm: AsyncLLM) -> tuple[list[RequestOutput], list[RequestOutput]]:
        waiting: list[RequestOutput] = []
        running: list[RequestOutput] = []

        async def first() -> None:
            async for out in llm.generate(prompts()[1], LONG, "running"):
                running.append(out)
                if len(running) == 2:
                    assert (await llm.stats()).num_waiting == 1
                    await llm.abort("queued")
                    await llm.abort("running")

        async def second() -> None:
            async for out in llm.generate(prompts()[2], GREEDY, "queued"):
                waiting.append(out)

        await asyncio.gather(first(), second())
        await idle_stats(llm, tries=1)
        return running, waiting

    running, waiting = run_with(llama_dir, body, max_num_seqs=1)
    assert running[-1].finish_reason == "abort"
    assert len(waiting) == 1 and waiting[0].finished and waiting[0].finish_reason == "abort"
    assert waiting[0].token_ids == []
    ts = waiting[0].timestamps
    assert ts is not None and ts.scheduled is None and ts.first_token is None
    assert ts.finished is not None and ts.finished >= ts.arrival


def test_abort_of_an_unknown_or_finished_request_is_harmless(llama_dir: pathlib.Path) -> None:
    async def body(llm: AsyncLLM) -> list[RequestOutput]:
        outs = await collect(llm, prompts()[0], GREEDY, "done")
        await llm.abort("done")
        await llm.abort("never-existed")
        outs += await collect(llm, prompts()[0], GREEDY, "done")  # the id is free again
        return outs

    outs = run_with(llama_dir, body)
    finals = [o for o in outs if o.finished]
    assert [o.finish_reason for o in finals] == ["length", "length"]
    assert finals[0].token_ids == finals[1].token_ids


def test_breaking_out_of_the_stream_aborts_the_request(llama_dir: pathlib.Path) -> None:
    async def body(llm: AsyncLLM) -> tuple[int, EngineStats]:
        seen = 0
        async for _ in llm.generate(prompts()[4], LONG, "quitter"):
            seen += 1
            if seen == 2:
                break  # the generator is finalized (and aborts) once the event loop gets to it
        return seen, await idle_stats(llm)

    seen, stats = run_with(llama_dir, body)
    assert seen == 2
    assert stats.generation_tokens < LONG.max_tokens  # stopped early, not run to the end


def test_closing_the_stream_aborts_at_once(llama_dir: pathlib.Path) -> None:
    async def body(llm: AsyncLLM) -> EngineStats:
        stream = cast(AsyncGenerator[RequestOutput, None], llm.generate(prompts()[4], LONG))
        async with contextlib.aclosing(stream):
            async for _ in stream:
                break
        return await llm.stats()  # commands run in order: the abort went first

    stats = run_with(llama_dir, body)
    assert stats.num_running == stats.num_kv_blocks_used == 0
    assert stats.generation_tokens < LONG.max_tokens


def test_cancelling_the_consumer_aborts_the_request(llama_dir: pathlib.Path) -> None:
    async def body(llm: AsyncLLM) -> EngineStats:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in llm.generate(prompts()[5], LONG):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await idle_stats(llm)

    stats = run_with(llama_dir, body)
    assert stats.generation_tokens < LONG.max_tokens


# -- errors -------------------------------------------------------------------------------------------------------


def test_bad_request_raises_to_its_caller_only(llama_dir: pathlib.Path) -> None:
    ps = prompts()
    bad_params = SamplingParams(max_tokens=4)
    bad_params.top_p = 0.0

    async def body(llm: AsyncLLM) -> tuple[list[Any], bool]:
        results = await asyncio.gather(
            collect(llm, ps[0], GREEDY),
            collect(llm, [5, -1], GREEDY),
            collect(llm, ps[1], GREEDY, "same-id"),
            collect(llm, ps[2], bad_params),
            collect(llm, ps[2], GREEDY, "same-id"),
            collect(llm, "", GREEDY),
            collect(llm, ps[3], GREEDY),
            return_exceptions=True,
        )
        await idle_stats(llm, tries=1)
        return list(results), llm.is_alive

    results, alive = run_with(llama_dir, body)
    assert alive
    errors = {1: "token id -1", 3: "top_p", 4: "request_id 'same-id' is already in use", 5: "prompt is empty"}
    for i, fragment in errors.items():
        assert isinstance(results[i], ValueError), (i, results[i])
        assert fragment in str(results[i])
    good = [results[i] for i in (0, 2, 6)]
    for outs in good:
        assert isinstance(outs, list)
        check_stream(outs)
    expected = LLM(LLMEngine.from_hf(llama_dir, options())).generate([ps[0], ps[1], ps[3]], GREEDY)
    assert [o[-1].token_ids for o in good] == [e.token_ids for e in expected]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_failure_fails_every_stream_and_later_calls(
    llama_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(llm: AsyncLLM) -> tuple[list[Any], bool]:
        real_run = llm.engine.runner.run
        calls = 0

        def flaky(batch: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 4:
                raise RuntimeError("device lost")
            return real_run(batch)

        monkeypatch.setattr(llm.engine.runner, "run", flaky)
        results = await asyncio.gather(*(collect(llm, p, LONG) for p in prompts()[:3]), return_exceptions=True)
        with pytest.raises(EngineDeadError, match="device lost"):
            await llm.stats()
        return list(results), llm.is_alive

    results, alive = run_with(llama_dir, body)
    assert not alive
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results), results


# -- timestamps ---------------------------------------------------------------------------------------------------


def test_timestamps_are_ordered(llama_dir: pathlib.Path) -> None:
    async def body(llm: AsyncLLM) -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(collect(llm, p, GREEDY) for p in prompts()[:5])))

    for outs in run_with(llama_dir, body, max_num_seqs=2):  # some requests wait for a slot
        ts = outs[-1].timestamps
        assert ts is not None
        assert ts.scheduled is not None and ts.first_token is not None and ts.finished is not None
        assert ts.arrival <= ts.scheduled <= ts.first_token <= ts.finished


# -- shutdown -----------------------------------------------------------------------------------------------------


def test_shutdown_stops_the_engine_thread(llama_dir: pathlib.Path) -> None:
    async def main() -> bool:
        llm = AsyncLLM(LLMEngine.from_hf(llama_dir, options()))
        outs = await collect(llm, prompts()[0], GREEDY)
        assert outs[-1].finished
        assert llm.is_alive
        llm.shutdown()
        return llm.is_alive or llm._thread.is_alive()

    assert asyncio.run(main()) is False


def test_calls_after_shutdown_raise_instead_of_hanging(llama_dir: pathlib.Path) -> None:
    async def main() -> None:
        llm = AsyncLLM(LLMEngine.from_hf(llama_dir, options()))
        llm.shutdown()
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(llm.stats(), 2.0)
        with pytest.raises(RuntimeError):
            await asyncio.wait_for(collect(llm, prompts()[0], GREEDY), 2.0)

    asyncio.run(main())


def test_shutdown_ends_streams_in_flight(llama_dir: pathlib.Path) -> None:
    async def main() -> None:
        llm = AsyncLLM(LLMEngine.from_hf(llama_dir, options()))
        got: list[RequestOutput] = []
        started = asyncio.Event()

        async def consume() -> None:
            async for out in llm.generate(prompts()[0], LONG):
                got.append(out)
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        llm.shutdown()
        try:
            await asyncio.wait_for(task, 2.0)  # either a final (aborted) output or an error, but an end
        except RuntimeError:
            pass
        else:
            assert got[-1].finished

    asyncio.run(main())
