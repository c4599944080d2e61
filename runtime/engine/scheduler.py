"""Continuous batching: each step spends a token budget on running sequences first, then admits waiting ones.

There is no separate prefill phase. Every sequence has tokens known and tokens computed; a step closes
part of that gap (one token for a decoding sequence, a chunk of a prompt otherwise). When the KV pool
runs dry, the most recently admitted sequence is preempted: its blocks are freed and it is recomputed
later, helped by whatever of its prefix is still cached.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from warmstart.runtime.engine.block_manager import BlockManager
from warmstart.runtime.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # new tokens computed this step, per sequence
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination), before the step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        sliding_window: int | None = None,
        lookahead: Callable[[Sequence], int] | None = None,
        admit: Callable[[Sequence, list[Sequence]], bool] | None = None,
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sliding_window = sliding_window
        # Speculative tokens a decoding sequence may verify this step, on top of its one (see speculative).
        # They count against the token budget, and only ever take blocks that are free: never a preemption.
        self.lookahead = lookahead
        # Whether a waiting sequence may start now, given the running ones (a LoRA adapter must get a device
        # slot: runtime/engine/lora.py). One that may not stays in its place; those behind it go on.
        self.admit = admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.sliding_window is not None:
                self.blocks.free_outside_window(seq, self.sliding_window)
            wanted = seq.num_tokens - seq.num_computed_tokens
            if wanted == 1 and self.lookahead is not None:
                wanted += self.lookahead(seq)
            wanted = min(wanted, budget)
            while (n := self.blocks.grow(seq, wanted)) == 0:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
                i += 1

        held: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if self.admit is not None and not self.admit(seq, self.running):
                held.append(self.waiting.popleft())
                continue
            n = self.blocks.start(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.timestamps.scheduled is None:
                seq.timestamps.scheduled = time.monotonic()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(held))
        batch.block_copies, self.blocks.pending_copies = self.blocks.pending_copies, []
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the engine, wherever it is, and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.timestamps.finished = time.monotonic()

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free_seq(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
