"""Turns a scheduled batch into tensors, runs the model over the paged KV pool and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.attention import AttentionGroup, AttentionMetadata
from runtime.model import Model
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from runtime.scheduler import ScheduledBatch
from runtime.sequence import Sequence, TokenLogprobs

# Fixed cost of one more decode group, in KV blocks' worth of attention work: a group costs a few ops per
# layer. benchmarks/decode_groups.py (40 sequences, prompts of 8-1024 tokens, SmolLM2-135M, bf16, 2 cores):
# one group 297 ms a step, split at 32 / 64 / 128 blocks 237 / 254 / 225 ms.
DECODE_GROUP_COST_BLOCKS = 128


@dataclass
class StepInputs:
    """Everything one forward pass needs, already as tensors: what tensor-parallel followers receive."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor
    highest_block: int  # the highest pool block the step touches (zeroed first if never used)
    block_copies: list[tuple[int, int]]  # (source, destination) blocks copied before the step


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int, seed: int | None = None) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        # One pool per layer: [2 (K, V), kv_heads, num_blocks, block_size, head_dim], head-major so that a
        # head's gathered keys are contiguous. Left uninitialized so a large pool costs nothing at start;
        # blocks are zeroed on first use (see _zero_new_blocks).
        self.kv_caches = [
            torch.empty(2, c.num_kv_heads, num_blocks, block_size, c.head_dim, dtype=model.dtype)
            for _ in range(c.num_layers)
        ]
        self.zeroed_blocks = 0
        self.sampler = Sampler(seed)
        self.window = c.uniform_window
        # Called with each step's inputs before it runs (rank 0 of a tensor-parallel group sends them on).
        self.before_step: Callable[[StepInputs], None] | None = None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:
        """Compute the batch; return the sequences that reached their last known token and their samples."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_seqs: list[Sequence] = []
        groups: list[AttentionGroup] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_rows.append(row)
                decode_seqs.append(seq)
            else:
                groups.append(self._group(slice(row, row + n), [seq], torch.arange(start, start + n), False))
            if start + n == seq.num_tokens:
                logits_rows.append(row + n - 1)
                sampled.append(seq)
            row += n
        widths = [s.num_computed_tokens // bs + 1 for s in decode_seqs]
        for members in split_by_length(widths, DECODE_GROUP_COST_BLOCKS):
            seqs = [decode_seqs[i] for i in members]
            q_pos = torch.tensor([s.num_computed_tokens for s in seqs])
            groups.append(self._group(torch.tensor([decode_rows[i] for i in members]), seqs, q_pos, True))

        step = StepInputs(
            input_ids=torch.tensor(input_ids),
            positions=torch.tensor(positions),
            meta=AttentionMetadata(slot_mapping=torch.tensor(slots), groups=groups),
            logits_index=torch.tensor(logits_rows, dtype=torch.long),
            highest_block=max(max(s.block_table) for s in batch.seqs),
            block_copies=list(batch.block_copies),
        )
        logits = self.execute(step)
        if not sampled:
            return [], [], []
        tokens, logprobs = self.sampler(logits, sampled)
        return sampled, tokens, logprobs

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor:
        """Prepare the pool for the step and run it; returns the logits of ``step.logits_index``'s rows."""
        if self.before_step is not None:
            self.before_step(step)
        self._zero_new_blocks(step.highest_block)
        for src, dst in step.block_copies:
            for cache in self.kv_caches:
                cache[:, :, dst] = cache[:, :, src]
        return self.model.forward(step.input_ids, step.positions, self.kv_caches, step.meta, step.logits_index)

    @torch.inference_mode()
    def virtual_tokens_kv(self, embeds: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """Run the model over input embeddings [n, hidden] at positions 0..n-1, writing their KV into
        ``blocks``; return that KV in the pool's layout, [num_layers, 2, kv_heads, len(blocks), block_size,
        head_dim] (soft prompts: see runtime/adapters.py)."""
        n, bs = embeds.shape[0], self.block_size
        assert len(blocks) == -(-n // bs)
        seq = Sequence("virtual-tokens", [0] * n, n, SamplingParams(max_tokens=1), block_table=blocks)
        group = self._group(slice(0, n), [seq], torch.arange(n), False)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
        self._zero_new_blocks(max(blocks))
        meta = AttentionMetadata(slot_mapping=slots, groups=[group])
        no_logits = torch.empty(0, dtype=torch.long)
        self.model.forward(torch.zeros(n, dtype=torch.long), torch.arange(n), self.kv_caches, meta, no_logits,
                           inputs_embeds=embeds.to(self.model.dtype))
        index = torch.tensor(blocks, dtype=torch.long)
        return torch.stack([cache.index_select(2, index) for cache in self.kv_caches])

    def fill_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Write KV computed elsewhere, [num_layers, 2, kv_heads, len(blocks), block_size, head_dim], into blocks."""
        self._zero_new_blocks(max(blocks))  # so that lazy zeroing never overwrites what is written here
        index = torch.tensor(blocks, dtype=torch.long)
        for cache, layer_kv in zip(self.kv_caches, kv, strict=True):
            cache.index_copy_(2, index, layer_kv.to(cache.dtype))

    def _zero_new_blocks(self, highest_block: int) -> None:
        """Attention reads whole blocks and masks what is past a sequence's end; masked garbage must still
        be finite (0 * NaN is NaN), so memory that was never written is zeroed before its first read."""
        if highest_block >= self.zeroed_blocks:
            for cache in self.kv_caches:
                cache[:, :, self.zeroed_blocks : highest_block + 1].zero_()
            self.zeroed_blocks = highest_block + 1

    def _group(
        self, rows: slice | torch.Tensor, seqs: list[Sequence], query_positions: torch.Tensor, is_decode: bool
    ) -> AttentionGroup:
        """Block tables of ``seqs``, from the first block any of their queries can see, padded to one width."""
        bs = self.block_size
        first = 0
        if self.window is not None:
            first = max(0, int(query_positions.min()) - self.window + 1) // bs
        end = max(-(-(s.num_computed_tokens + (1 if is_decode else len(query_positions))) // bs) for s in seqs)
        width = max(1, end - first)
        tables = [[max(b, 0) for b in s.block_table[first:end]] for s in seqs]
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
