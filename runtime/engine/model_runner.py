"""Turns a scheduled batch into tensors, runs the model over the paged KV pool and samples."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from warmstart.runtime.engine.cuda_graphs import (
    CAPTURE_BUDGET_S,
    DEFAULT_BATCH_SIZES,
    DecodeGraphs,
    GraphBackend,
    batch_sizes_for,
)
from warmstart.runtime.engine.lora import LoraManager
from warmstart.runtime.engine.prompt_logprobs import record_prompt_logprobs, wants_prompt_logits
from warmstart.runtime.engine.rejection_sampler import verify
from warmstart.runtime.engine.sampler import Sampler
from warmstart.runtime.engine.scheduler import ScheduledBatch
from warmstart.runtime.engine.sequence import Sequence, TokenLogprobs
from warmstart.runtime.engine.structured import apply_grammar_masks
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata
from warmstart.runtime.layers.lora import LoraStep
from warmstart.runtime.models.model import Model
from warmstart.runtime.timeline import Timeline

# Fixed cost of one more decode group, in KV blocks' worth of attention work, where decode attention pads
# every sequence to the longest of its group (the gather path of runtime/layers/attention.py): a group costs a few
# ops per layer. Measured (docs/BENCHMARKS.md, decode groups; 40 sequences, prompts of 8-1024 tokens, SmolLM2-135M,
# bf16, 2 cores): one group 297 ms a step, split at 32 / 64 / 128 blocks 237 / 254 / 225 ms.
DECODE_GROUP_COST_BLOCKS = 128
GRAPHS_ENV = "WARMSTART_CUDA_GRAPHS"  # "0": no CUDA graphs for decode on the CUDA path


@dataclass
class Chunk:
    """One sequence's tokens to compute in a forward pass, at positions ``start``.. of its block table."""

    block_table: list[int]
    token_ids: list[int]
    start: int
    num_logits: int  # logits wanted for this many of the chunk's last tokens
    # Attend each token as a decode query of its own (causal over the chunk, the pool holding its KV first):
    # a speculative verification then rounds exactly as the one-token steps it stands for, and joins the
    # batched decode groups instead of costing a group of its own.
    as_decode_rows: bool = False
    lora_slot: int = -1  # the device slot of the sequence's LoRA adapter, -1 for none


@dataclass
class StepInputs:
    """Everything one forward pass needs, already as tensors: what tensor-parallel followers receive."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor
    highest_block: int  # the highest pool block the step touches (zeroed first if never used)
    block_copies: list[tuple[int, int]]  # (source, destination) blocks copied before the step
    lora: LoraStep | None = None  # the rows' LoRA adapters


class ModelRunner:
    def __init__(
        self, model: Model, num_blocks: int, block_size: int, seed: int | None = None,
        before_step: Callable[[StepInputs], None] | None = None, max_batch: int = DEFAULT_BATCH_SIZES[-1],
    ) -> None:  # fmt: skip
        c = model.config
        self.model = model
        self.block_size = block_size
        # One pool per layer: [2 (K, V), kv_heads, num_blocks, block_size, head_dim], head-major so that a
        # head's gathered keys are contiguous. Left uninitialized so a large pool costs nothing at start;
        # blocks are zeroed on first use (see _zero_new_blocks).
        self.device = model.weights.embed.device
        self.kv_caches = [
            torch.empty(2, c.num_kv_heads, num_blocks, block_size, c.head_dim, dtype=model.dtype, device=self.device)
            for _ in range(c.num_layers)
        ]
        self.zeroed_blocks = 0
        self.sampler = Sampler(seed)
        self.window = c.uniform_window
        # Called with each step's inputs before it runs (rank 0 of a tensor-parallel group sends them on).
        self.before_step = before_step
        self.graphs: DecodeGraphs | None = None
        self.loras: LoraManager | None = None  # set by the engine: the LoRA adapters' device slots
        # What this runner paid before it could serve (kernels, graphs), which the loader puts on the cold start's.
        self.timeline = Timeline(origin="runner_start")
        # A tensor-parallel shard's forward is a collective: every rank would have to warm up and capture
        # together, so its first steps compile and it runs without graphs.
        if self.device.type == "cuda" and model.ops.name == "triton" and not model.sharded:
            self.warm_up_kernels()
            if os.environ.get(GRAPHS_ENV) != "0":
                self.capture_decode_graphs(batch_sizes_for(max_batch), budget_s=CAPTURE_BUDGET_S)

    def warm_up_kernels(self) -> None:
        """Call every kernel of a prefill and a decode step once, so that what Triton compiles (or loads from
        its carried cache) is paid before serving and shows in the timeline, not in the first request. The
        block table is all -1: the KV writes skip negative slots and attention reads the zeroed block 0."""
        from warmstart.runtime.kernels import cached_kernels, carried_cache_dir

        cache_dir = carried_cache_dir(self.device)
        before = cached_kernels(cache_dir)
        start = time.perf_counter()
        self._zero_new_blocks(0)
        prompt = 5
        table = [-1] * -(-(prompt + 1) // self.block_size)
        with torch.inference_mode():
            self.forward([Chunk(table, [0] * prompt, 0, 1)])  # prefill
            self.forward([Chunk(table, [0], prompt, 1)])  # decode
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        details: dict[str, Any] = {
            "seconds": round(time.perf_counter() - start, 4),
            "cache_dir": str(cache_dir),
            "carried": before,  # compiled kernels found in the cache
            "compiled": cached_kernels(cache_dir) - before,  # compiled here, not found
        }
        self.timeline.mark("kernels", **details)

    def capture_decode_graphs(
        self, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, budget_s: float | None = None,
        backend: GraphBackend | None = None,
    ) -> None:  # fmt: skip
        """On CUDA: replay decode-only steps of up to max(batch_sizes) sequences from captured graphs. With
        ``budget_s``, only the smallest sizes that fit it are captured now, the others when a batch first
        needs them or the engine idles (see runtime/engine/cuda_graphs.py)."""
        self._zero_new_blocks(0)  # padding rows read block 0
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, batch_sizes, backend)
        if budget_s is None:
            self.graphs.capture_all()
        else:
            self.graphs.capture_within(budget_s)
        seconds = sum(self.graphs.capture_seconds.values())
        self.timeline.mark("graphs", seconds=round(seconds, 4), batch_sizes=sorted(self.graphs.graphs),
                           deferred=self.graphs.pending[:])

    def capture_pending_graph(self) -> bool:
        """Capture one decode graph left for later (the engine calls this when idle); False when none is left."""
        return self.graphs is not None and self.graphs.capture_next()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[tuple[Sequence, list[int], list[TokenLogprobs | None]]]:
        """Compute the batch; return each sequence that reached its last known token with the tokens it
        gained: one sampled token, or (speculating) its accepted proposals and one more."""
        chunks = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            ids = seq.token_ids[start : start + n]
            ids += seq.spec_token_ids[: n - len(ids)]
            every = seq.spec_token_ids or wants_prompt_logits(seq, start)
            num_logits = n if every else int(start + n == seq.num_tokens)
            slot = self.loras.slot(seq.lora) if seq.lora is not None and self.loras is not None else -1
            chunks.append(Chunk(seq.block_table, ids, start, num_logits, as_decode_rows=bool(seq.spec_token_ids),
                                lora_slot=slot))
        logits = self.forward(chunks, batch.block_copies).cpu()  # the sampler works on the host
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        plain_index: list[int] = []
        results: dict[int, tuple[Sequence, list[int], list[TokenLogprobs | None]]] = {}
        row = 0
        for i, (seq, chunk) in enumerate(zip(batch.seqs, chunks, strict=True)):
            if seq.spec_token_ids:
                results[i] = (seq, *verify(self.sampler, logits[row : row + chunk.num_logits], seq))
            elif chunk.num_logits:
                if wants_prompt_logits(seq, chunk.start):
                    record_prompt_logprobs(seq, chunk.start, logits[row : row + chunk.num_logits])
                if chunk.start + len(chunk.token_ids) == seq.num_tokens:  # the last known token: sample
                    last = row + chunk.num_logits - 1
                    for s in [seq, *seq.forks]:  # forks: only before its first token, so this row is the prompt's
                        # last; n > 1: the other choices draw their first token from it (the prompt computed once)
                        plain.append(s)
                        plain_rows.append(last)
                        plain_index.append(i if s is seq else len(batch.seqs) + len(plain))
            row += chunk.num_logits
        if plain:
            plain_logits = logits[plain_rows]
            # Structured outputs: the tokens each constrained row's grammar forbids go to -inf.
            if apply_grammar_masks(plain_logits, [s.grammar for s in plain]):
                tokens, _ = self.sampler(plain_logits, plain)
                # The logprobs stay the model's own, as for penalties and biases (vLLM's default).
                logprobs = self.sampler.logprobs(logits[plain_rows], tokens, [s.params for s in plain])
            else:
                tokens, logprobs = self.sampler(plain_logits, plain)
            for i, seq, token, lp in zip(plain_index, plain, tokens, logprobs, strict=True):
                results[i] = (seq, [token], [lp])
        return [results[i] for i in sorted(results)]

    def forward(
        self,
        chunks: list[Chunk],
        copies: list[tuple[int, int]] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Write the chunks' KV into the pool; return float32 logits for each chunk's last ``num_logits``
        tokens, in chunk order (with ``hidden``: their final hidden states). One token over a cached prefix is a
        decode; more are attended causally. ``copies``: (source, destination) blocks copied first (adapters'
        partial blocks, see the block manager); ``inputs_embeds`` replaces the tokens' embeddings (soft prompts,
        at build time)."""
        copies = copies or []
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_chunks: list[Chunk] = []
        groups: list[AttentionGroup] = []
        logits_rows: list[int] = []
        row_slots: list[int] = []
        row = 0
        for chunk in chunks:
            start, n, table = chunk.start, len(chunk.token_ids), chunk.block_table
            input_ids.extend(chunk.token_ids)
            row_slots.extend([chunk.lora_slot] * n)
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_rows.append(row)
                decode_chunks.append(chunk)
            elif chunk.as_decode_rows:
                decode_rows.extend(range(row, row + n))
                decode_chunks.extend(Chunk(table, [t], start + i, 0) for i, t in enumerate(chunk.token_ids))
            else:
                groups.append(self._group(slice(row, row + n), [chunk], torch.arange(start, start + n), False))
            logits_rows.extend(range(row + n - chunk.num_logits, row + n))
            row += n
        if self.model.ops.ragged_decode:
            decode_groups = [list(range(len(decode_chunks)))] if decode_chunks else []
        else:
            decode_groups = split_by_length([c.start // bs + 1 for c in decode_chunks], DECODE_GROUP_COST_BLOCKS)
        for members in decode_groups:
            members_chunks = [decode_chunks[i] for i in members]
            q_pos = torch.tensor([c.start for c in members_chunks])
            groups.append(self._group(torch.tensor([decode_rows[i] for i in members]), members_chunks, q_pos, True))

        highest_block = max(max(c.block_table) for c in chunks)
        lora = self.loras.step(row_slots) if self.loras is not None and max(row_slots) >= 0 else None
        if (self.graphs is not None and inputs_embeds is None and lora is None and not hidden
                and len(decode_chunks) == len(chunks) == len(input_ids)):
            self._prepare(highest_block, copies)
            copies = []
            tables = [[max(b, 0) for b in c.block_table] for c in chunks]
            logits = self.graphs.run(input_ids, positions, slots, tables)
            if logits is not None:
                return logits[logits_rows]
        device = self.device
        step = StepInputs(
            input_ids=torch.tensor(input_ids, device=device),
            positions=torch.tensor(positions, device=device),
            meta=AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), groups=groups),
            logits_index=torch.tensor(logits_rows, dtype=torch.long, device=device),
            highest_block=highest_block,
            block_copies=list(copies),
            lora=lora,
        )
        return self.execute(step, inputs_embeds, hidden)

    @torch.inference_mode()
    def execute(
        self, step: StepInputs, inputs_embeds: torch.Tensor | None = None, hidden: bool = False
    ) -> torch.Tensor:
        """Prepare the pool for the step and run it; returns the logits of ``step.logits_index``'s rows (with
        ``hidden``, their final hidden states: never on a tensor-parallel group, whose followers compute logits)."""
        if self.before_step is not None:
            assert not hidden, "a tensor-parallel group computes logits only"
            self.before_step(step)
        self._prepare(step.highest_block, step.block_copies)
        return self.model.forward(step.input_ids, step.positions, self.kv_caches, step.meta, step.logits_index,
                                  inputs_embeds=inputs_embeds, lora=step.lora, hidden=hidden)

    def _prepare(self, highest_block: int, copies: list[tuple[int, int]]) -> None:
        self._zero_new_blocks(highest_block)
        for src, dst in copies:
            for cache in self.kv_caches:
                cache[:, :, dst] = cache[:, :, src]

    @torch.inference_mode()
    def virtual_tokens_kv(self, embeds: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """Run the model over input embeddings [n, hidden] at positions 0..n-1, writing their KV into
        ``blocks``; return that KV in the pool's layout, [num_layers, 2, kv_heads, len(blocks), block_size,
        head_dim] (soft prompts: see runtime/engine/adapters.py)."""
        n = embeds.shape[0]
        assert len(blocks) == -(-n // self.block_size)
        self.forward([Chunk(blocks, [0] * n, 0, 0)], inputs_embeds=embeds.to(self.device, self.model.dtype))
        return self.read_blocks(blocks)

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A copy of blocks' KV, [num_layers, 2, kv_heads, len(blocks), block_size, head_dim] (fill_blocks' input)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return torch.stack([cache.index_select(2, index) for cache in self.kv_caches])

    def fill_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Write KV computed elsewhere, [num_layers, 2, kv_heads, len(blocks), block_size, head_dim], into blocks."""
        self._zero_new_blocks(max(blocks))  # so that lazy zeroing never overwrites what is written here
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for cache, layer_kv in zip(self.kv_caches, kv, strict=True):
            cache.index_copy_(2, index, layer_kv.to(cache.device, cache.dtype))

    def _zero_new_blocks(self, highest_block: int) -> None:
        """Attention reads whole blocks and masks what is past a sequence's end; masked garbage must still
        be finite (0 * NaN is NaN), so memory that was never written is zeroed before its first read."""
        if highest_block >= self.zeroed_blocks:
            for cache in self.kv_caches:
                cache[:, :, self.zeroed_blocks : highest_block + 1].zero_()
            self.zeroed_blocks = highest_block + 1

    def _group(
        self, rows: slice | torch.Tensor, chunks: list[Chunk], query_positions: torch.Tensor, is_decode: bool
    ) -> AttentionGroup:
        """Block tables of ``chunks``, from the first block any of their queries can see, padded to one width."""
        bs = self.block_size
        first = 0
        if self.window is not None:
            first = max(0, int(query_positions.min()) - self.window + 1) // bs
        end = max(-(-(c.start + len(c.token_ids)) // bs) for c in chunks)
        width = max(1, end - first)
        tables = [[max(b, 0) for b in c.block_table[first:end]] for c in chunks]
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        return AttentionGroup(
            rows=rows,
            block_tables=table,
            query_positions=query_positions,
            first_key_position=first * bs,
            is_decode=is_decode,
            block_size=bs,
        )


def split_by_length(widths: list[int], group_cost: int) -> list[list[int]]:
    """Split decode sequences (by index) into groups, each padded only to its own longest member.

    One group pads every sequence to the longest in the batch; with mixed lengths most of the gathered and
    multiplied keys are then padding. Sorted by width, the best split into runs is a small dynamic program:
    a run costs its size times its widest member, plus ``group_cost`` (O(B^2), under a millisecond at B=64).
    """
    order = sorted(range(len(widths)), key=widths.__getitem__, reverse=True)
    sorted_widths = [widths[i] for i in order]
    best = [0] + [0] * len(order)  # best[i]: cost of the first i sequences
    cut = [0] * (len(order) + 1)  # where the last run of best[i] starts
    for i in range(1, len(order) + 1):
        best[i], cut[i] = min((best[j] + (i - j) * sorted_widths[j] + group_cost, j) for j in range(i))
    groups = []
    i = len(order)
    while i > 0:
        groups.append(sorted(order[cut[i] : i]))  # rows stay in batch order within a group
        i = cut[i]
    return groups[::-1]
