"""CUDA graphs of the decode step, captured at a few batch sizes and replayed for any decode-only batch that
fits one (the CUDA path; the Triton kernels are what makes the step capturable).

A decode step launches a few kernels per layer, each too short to hide its launch; replaying a graph
launches them all at once. Everything a step reads lives in static device buffers: token ids, positions,
slots and block tables as wide as the pool (a sequence has at most every block). The attention kernel's
launch shape depends only on the batch and the table width, never on the lengths, so one graph serves any
lengths. Rows past the batch are padding: slot -1 (the KV write skips them) and one key each.
"""

from __future__ import annotations

import torch

from runtime.layers.attention import AttentionGroup, AttentionMetadata
from runtime.models.model import Model

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class DecodeGraphs:
    def __init__(
        self, model: Model, kv_caches: list[torch.Tensor], block_size: int, batch_sizes: tuple[int, ...]
    ) -> None:
        device = model.weights.embed.device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {device}")
        largest, width = max(batch_sizes), kv_caches[0].shape[2]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(largest, width, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in sorted(batch_sizes, reverse=True):  # the largest first: the others reuse its memory pool
            group = AttentionGroup(slice(0, size), self.tables[:size], self.positions[:size], 0, True, block_size)
            meta = AttentionMetadata(slot_mapping=self.slots[:size], groups=[group])
            rows = torch.arange(size, device=device)

            def step(size: int = size, meta: AttentionMetadata = meta, rows: torch.Tensor = rows) -> torch.Tensor:
                return model.forward(self.input_ids[:size], self.positions[:size], kv_caches, meta, rows)

            step()  # compiles (or loads) every kernel outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = step()
            pool = graph.pool()
            self.graphs[size] = graph

    def run(
        self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]
    ) -> torch.Tensor | None:
        """Logits [B, vocab] of a decode batch of B sequences, or None when no captured size holds B."""
        batch = len(input_ids)
        size = min((s for s in self.graphs if s >= batch), default=None)
        if size is None or max(len(t) for t in tables) > self.tables.shape[1]:
            return None
        table = torch.zeros(size, self.tables.shape[1], dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t)
        pad = size - batch
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:size].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.tables[:size].copy_(table, non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:batch]
