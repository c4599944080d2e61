"""Decode graphs without a GPU: which sizes are captured when (before serving within a budget, when a batch
needs one, while the engine idles), and that a replayed batch computes what the eager step computes.

The CUDA calls sit behind DecodeGraphs' backend; tests.support.graphs.RerunBackend stands in on the CPU. The
engine tests run the Triton kernels under the interpreter (padding rows write to slot -1, which only the
Triton KV write skips).
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from tests.support.graphs import AddressBackend, RerunBackend
from warmstart.runtime import AsyncLLM, EngineOptions, LLMEngine, SamplingParams
from warmstart.runtime.engine.cuda_graphs import DecodeGraphs, batch_sizes_for
from warmstart.runtime.models.model import Model

ModelDir = Callable[[str], pathlib.Path]


class TimedBackend(RerunBackend):
    """Capture that takes ``seconds[size]`` on a fake clock."""

    def __init__(self, seconds: dict[int, float]) -> None:
        super().__init__()
        self.now, self.seconds = 0.0, seconds

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        replay, out = super().capture(step)
        self.now += self.seconds[out.shape[0]]
        return replay, out


def stub_graphs(
    sizes: tuple[int, ...], backend: RerunBackend, clock: Callable[[], float] = time.perf_counter
) -> DecodeGraphs:
    model = SimpleNamespace(weights=SimpleNamespace(embed=torch.zeros(1)),
                            forward=lambda ids, pos, kv, meta, rows: torch.zeros(len(rows), 4))
    return DecodeGraphs(cast(Model, model), [torch.zeros(2, 1, 8, 4, 2)], 4, sizes, backend, clock)


def test_sizes_stop_at_the_first_that_holds_max_num_seqs() -> None:
    assert batch_sizes_for(1) == (1,)
    assert batch_sizes_for(5) == (1, 2, 4, 8)
    assert batch_sizes_for(8) == (1, 2, 4, 8)
    assert batch_sizes_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_sizes_for(200) == (1, 2, 4, 8, 16, 32, 64)  # larger batches run eagerly


@pytest.mark.parametrize(("budget", "captured"), [(0.0, [1]), (0.3, [1, 2]), (0.5, [1, 2, 4]), (9.0, [1, 2, 4, 8])])
def test_capture_before_serving_stays_within_the_budget(budget: float, captured: list[int]) -> None:
    backend = TimedBackend({1: 0.1, 2: 0.15, 4: 0.2, 8: 0.3})
    graphs = stub_graphs((8, 4, 2, 1), backend, clock=lambda: backend.now)
    assert graphs.capture_within(budget) == captured
    assert sorted(graphs.graphs) == captured
    assert graphs.pending == [s for s in (1, 2, 4, 8) if s not in captured]
    assert graphs.capture_seconds == {s: backend.seconds[s] for s in captured}


def test_a_batch_captures_the_smallest_pending_size_that_holds_it() -> None:
    graphs = stub_graphs((1, 2, 4, 8), RerunBackend())
    graphs.capture_within(0.0)
    assert graphs.size_for(3) == 4 and sorted(graphs.graphs) == [1, 4]
    assert graphs.size_for(1) == 1 and graphs.size_for(4) == 4 and sorted(graphs.graphs) == [1, 4]
    assert graphs.size_for(2) == 2 and sorted(graphs.graphs) == [1, 2, 4]
    assert graphs.size_for(9) is None
    assert graphs.capture_next() and graphs.pending == [] and not graphs.capture_next()


@pytest.fixture
def triton_ops(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs here only where there is no GPU (conftest sets TRITON_INTERPRET)")
    monkeypatch.setenv("WARMSTART_KERNELS", "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))


def engine(model_dir: pathlib.Path, block_size: int = 8) -> LLMEngine:
    return LLMEngine.from_hf(model_dir, EngineOptions(dtype="float32", block_size=block_size, num_kv_blocks=32))


def generate(e: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [e.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        done.update((o.request_id, o.token_ids) for o in e.step() if o.finished)
    return [done[i] for i in ids]


PROMPTS = [[5, 6, 7], [9, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3]]


def test_replayed_decode_steps_generate_what_eager_steps_do(triton_ops: None, tiny_model_dir: ModelDir) -> None:
    model_dir = tiny_model_dir("llama")
    eager = generate(engine(model_dir), PROMPTS, 3)
    e = engine(model_dir)
    backend = RerunBackend()
    e.runner.capture_decode_graphs((1, 2, 4), budget_s=0.0, backend=backend)
    graphs = e.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1] and graphs.pending == [2, 4]
    assert generate(e, PROMPTS, 3) == eager
    assert backend.replays == 2  # two decode steps of three sequences, on the graph of 4 captured for them
    assert sorted(graphs.graphs) == [1, 4] and graphs.pending == [2]
    details = e.runner.timeline.details["graphs"]
    assert details["batch_sizes"] == [1] and details["deferred"] == [2, 4]


def test_every_tensor_a_captured_step_reads_outlives_the_capture(triton_ops: None, tiny_model_dir: ModelDir) -> None:
    """A replay reads the addresses the capture saw: a tensor made for the capture and dropped after it (as the
    row index once was) is memory the allocator hands out again, and on an H200 the replay's gather read garbage."""
    import gc

    e = engine(tiny_model_dir("llama"))
    backend = AddressBackend()
    e.runner.capture_decode_graphs((1, 4), budget_s=9.0, backend=backend)
    gc.collect()
    assert backend.read, "the recording saw no reads"
    assert backend.dropped() == []


def test_capture_after_serving_does_not_write_the_last_batch_kv(triton_ops: None, tiny_model_dir: ModelDir) -> None:
    e = engine(tiny_model_dir("llama"))
    seen: list[torch.Tensor] = []

    def record_slots() -> None:
        assert e.runner.graphs is not None
        seen.append(e.runner.graphs.slots.clone())

    e.runner.capture_decode_graphs((1, 2, 4), budget_s=0.0, backend=RerunBackend(record_slots))
    graphs = e.runner.graphs
    assert graphs is not None
    generate(e, PROMPTS, 2)  # the graph of 4 replays the last decode step: its slots stay in the buffers
    assert (graphs.slots[:3] >= 0).all()
    pool = [c.clone() for c in e.runner.kv_caches]
    graphs.capture(2)
    assert (seen[-1] == -1).all()  # the warm-up (the one step a capture runs) writes no KV
    # bit for bit: blocks never used are uninitialized memory, where a NaN is not equal to itself
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pool, e.runner.kv_caches,
                                                                                     strict=True))


@pytest.mark.parametrize("block_size", [2, 8])  # its prompt spans blocks, or fits one
def test_kernel_warm_up_leaves_the_pool_alone(triton_ops: None, tiny_model_dir: ModelDir, block_size: int) -> None:
    e = engine(tiny_model_dir("llama"), block_size)
    e.runner._zero_new_blocks(31)
    for cache in e.runner.kv_caches:
        cache.fill_(0.5)
    pool = [c.clone() for c in e.runner.kv_caches]
    e.runner.warm_up_kernels()
    assert all(torch.equal(a, b) for a, b in zip(pool, e.runner.kv_caches, strict=True))
    details = e.runner.timeline.details["kernels"]
    assert details["seconds"] > 0 and details["compiled"] == 0  # the interpreter compiles none


def test_the_engine_captures_deferred_sizes_while_idle(triton_ops: None, tiny_model_dir: ModelDir) -> None:
    e = engine(tiny_model_dir("llama"))
    e.runner.capture_decode_graphs((1, 2, 4), budget_s=0.0, backend=RerunBackend())
    graphs = e.runner.graphs
    assert graphs is not None and graphs.pending == [2, 4]

    async def idle_then_serve() -> list[int]:
        llm = AsyncLLM(e)
        try:
            for _ in range(600):
                if not graphs.pending:
                    break
                await asyncio.sleep(0.05)
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            return [out async for out in llm.generate(PROMPTS[0], params)][-1].token_ids
        finally:
            llm.shutdown()

    assert len(asyncio.run(idle_then_serve())) == 2
    assert sorted(graphs.graphs) == [1, 2, 4] and graphs.pending == []


def test_cuda_calls_run_with_the_model_s_gpu_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda stood in for: warm-up, capture and replay each happen with the model's GPU current, since the
    engine's threads keep cuda:0 current while the model may be on cuda:1."""
    from contextlib import contextmanager

    from warmstart.runtime.engine.cuda_graphs import CudaGraphs

    current: list[torch.device] = [torch.device("cuda", 0)]
    seen: dict[str, torch.device] = {}

    @contextmanager
    def device(d: torch.device) -> Any:
        current.append(d)
        yield
        current.pop()

    class Graph:
        def replay(self) -> None:
            seen["replay"] = current[-1]

    @contextmanager
    def graph(g: Graph, pool: Any = None) -> Any:
        seen["capture"] = current[-1]
        yield

    stream = SimpleNamespace(wait_stream=lambda other: None)
    for name, value in {"device": device, "CUDAGraph": Graph, "graph": graph, "graph_pool_handle": lambda: (0, 1),
                        "current_stream": lambda d=None: stream, "Stream": lambda d=None: stream,
                        "stream": lambda s: device(current[-1]), "synchronize": lambda d=None: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    gpu1 = torch.device("cuda", 1)
    backend = CudaGraphs(gpu1)
    backend.warm_up(lambda: seen.setdefault("warm_up", current[-1]) and torch.zeros(1))
    replay, _ = backend.capture(lambda: torch.zeros(1))
    replay()
    assert seen == {"warm_up": gpu1, "capture": gpu1, "replay": gpu1} and current == [torch.device("cuda", 0)]
