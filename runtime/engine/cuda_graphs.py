"""CUDA graphs of the decode step, captured at a few batch sizes and replayed for any decode-only batch that
fits one (the CUDA path; the Triton kernels are what makes the step capturable).

A decode step launches a few kernels per layer, each too short to hide its launch; replaying a graph
launches them all at once. Everything a step reads lives in static device buffers: token ids, positions,
slots and block tables as wide as the pool (a sequence has at most every block). The attention kernel's
launch shape depends only on the batch and the table width, never on the lengths, so one graph serves any
lengths. Rows past the batch are padding: slot -1 (the KV write skips them) and one key each.

Capture costs cold-start time, so it is spread out: before the engine serves, only the smallest sizes that
fit a time budget (batch size 1 at least: a cold start's first request comes alone); afterwards a size is
captured when a decode batch first needs it (one step waits for that one capture), or while the engine has
nothing else to do. Until then a batch runs eagerly, which computes the same logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata
from warmstart.runtime.models.model import Model

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Capture before serving stops once the next size would take the total past this (measured on the last one).
CAPTURE_BUDGET_S = 0.5


def batch_sizes_for(max_batch: int, sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> tuple[int, ...]:
    """The sizes a scheduler that runs at most ``max_batch`` sequences can use: up to the first that holds it."""
    wanted = tuple(s for s in sorted(sizes) if s < max_batch)
    covering = [s for s in sorted(sizes) if s >= max_batch]
    return wanted + tuple(covering[:1])


class GraphBackend(Protocol):
    """The device calls capture needs; CudaGraphs makes them, tests substitute one that runs on the CPU."""

    def warm_up(self, step: Callable[[], torch.Tensor]) -> None: ...

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        """``step`` recorded once; returns (replay, the output tensor each replay rewrites)."""
        ...


class CudaGraphs:
    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {device}")
        self.device = device
        # One memory pool for every graph: they never run at the same time, so they may share activations.
        self.pool = torch.cuda.graph_pool_handle()

    # Each call makes the model's device current: capture, its streams and a replay's launch go to the calling
    # thread's current device, and the engine's threads never chose one (cuda:0) while the model may be on cuda:N.

    def warm_up(self, step: Callable[[], torch.Tensor]) -> None:
        """Run ``step`` once outside capture, on a side stream as PyTorch's CUDA graph docs prescribe, so that
        kernels compile (or load) and libraries set up their workspaces before the capture."""
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                step()
            current.wait_stream(side)
            torch.cuda.synchronize(self.device)

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], Any], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool):
            out = step()

        def replay() -> None:
            with torch.cuda.device(self.device):
                graph.replay()

        return replay, out


class DecodeGraphs:
    def __init__(
        self, model: Model, kv_caches: list[torch.Tensor], block_size: int, batch_sizes: tuple[int, ...],
        backend: GraphBackend | None = None, clock: Callable[[], float] = time.perf_counter,
    ) -> None:  # fmt: skip
        device = model.weights.embed.device
        self.backend = backend or CudaGraphs(device)
        self.model, self.kv_caches, self.block_size, self.clock = model, kv_caches, block_size, clock
        largest, width = max(batch_sizes), kv_caches[0].shape[2]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(largest, width, dtype=torch.long, device=device)
        # A graph reads its inputs at the addresses captured, so even the constant row index is a buffer kept
        # here: a tensor made for the capture and then dropped goes back to the allocator, and replays would
        # read whatever is stored there next.
        self.rows = torch.arange(largest, dtype=torch.long, device=device)
        self.graphs: dict[int, Callable[[], Any]] = {}  # batch size -> replay
        self.logits: dict[int, torch.Tensor] = {}
        self.pending = sorted(set(batch_sizes))  # not captured yet, smallest first
        self.capture_seconds: dict[int, float] = {}  # batch size -> seconds its capture took (warm-up included)

    def capture(self, size: int) -> float:
        """Capture the decode step at batch ``size`` (one of the pending sizes); returns the seconds it took."""
        start = self.clock()
        group = AttentionGroup(slice(0, size), self.tables[:size], self.positions[:size], 0, True, self.block_size)
        meta = AttentionMetadata(slot_mapping=self.slots[:size], groups=[group])

        def step() -> torch.Tensor:
            return self.model.forward(
                self.input_ids[:size], self.positions[:size], self.kv_caches, meta, self.rows[:size]
            )

        with torch.inference_mode():
            # The buffers still hold the last replay's batch: its slots would be written by the warm-up.
            self.input_ids.zero_()
            self.positions.zero_()
            self.slots.fill_(-1)
            self.tables.zero_()
            self.backend.warm_up(step)
            self.graphs[size], self.logits[size] = self.backend.capture(step)
        self.pending.remove(size)
        self.capture_seconds[size] = self.clock() - start
        return self.capture_seconds[size]

    def capture_all(self) -> None:
        while self.pending:
            self.capture(self.pending[0])

    def capture_within(self, budget_s: float) -> list[int]:
        """Capture pending sizes, smallest first, while the total stays within ``budget_s`` (each next one
        assumed to take as long as the last); the first is always captured. Returns the sizes captured."""
        done: list[int] = []
        spent = last = 0.0
        while self.pending and (not done or spent + last <= budget_s):
            size = self.pending[0]
            last = self.capture(size)
            spent += last
            done.append(size)
        return done

    def capture_next(self) -> bool:
        """Capture the smallest pending size (when the engine is idle); False when none was left."""
        if not self.pending:
            return False
        self.capture(self.pending[0])
        return True

    def size_for(self, batch: int) -> int | None:
        """The captured size a batch of ``batch`` replays at; a pending one is captured first if it is the
        smallest that holds the batch (traffic needs it now). None: no size holds the batch."""
        captured = min((s for s in self.graphs if s >= batch), default=None)
        wanted = min((s for s in self.pending if s >= batch), default=None)
        if wanted is not None and (captured is None or wanted < captured):
            self.capture(wanted)
            return wanted
        return captured

    def run(
        self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]
    ) -> torch.Tensor | None:
        """Logits [B, vocab] of a decode batch of B sequences, or None when no graph can hold B."""
        batch = len(input_ids)
        if max(len(t) for t in tables) > self.tables.shape[1]:
            return None
        size = self.size_for(batch)
        if size is None:
            return None
        # The kernel reads a row's table only up to its sequence's last block (a padding row: block 0), so
        # only that many columns are sent, not the pool's width (64 rows x 32k blocks would be 16 MB a step).
        width = max(len(t) for t in tables)
        table = torch.zeros(size, width, dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t)
        pad = size - batch
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:size].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.tables[:size, :width].copy_(table, non_blocking=True)
        self.graphs[size]()
        return self.logits[size][:batch]
