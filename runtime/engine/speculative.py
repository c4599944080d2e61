"""Speculative decoding: cheap proposals of a sequence's next tokens, verified by the target in one pass.

A decoding sequence with k proposals computes k + 1 tokens in one step (its last token and the
proposals, causal over its cached prefix), which gives the target's distribution after each of them.
The model runner verifies proposals by the accept/resample rule of runtime/engine/rejection_sampler.py.

Proposers: prompt lookup (the continuation of the latest earlier match of the sequence's last n-gram)
and a draft model. The draft model keeps its own KV pool indexed by the target's block ids, so it needs
no block manager of its own: a sequence's blocks hold the target's KV in one pool and the draft's in
the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from warmstart.runtime.engine.block_manager import BlockManager
from warmstart.runtime.engine.model_runner import Chunk, ModelRunner
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.engine.sampler import Sampler
from warmstart.runtime.engine.scheduler import ScheduledBatch
from warmstart.runtime.engine.sequence import Sequence
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.model import Model


@dataclass
class SpecStats:
    num_drafts: int = 0  # verification passes (sequences x steps with proposals)
    num_draft_tokens: int = 0  # proposed tokens verified
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted plus the one the target adds each pass (before stop truncation)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def lookahead(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many proposals are worth verifying for a decoding sequence: none past its max_tokens or the
    context (the last proposal sits at position num_tokens - 1 + k)."""
    # Penalized rows depend on every token before them; choices of n > 1 share blocks the draft model would write.
    if not seq.params.speculative or seq.params.processes_logits or seq.params.n > 1:
        return 0
    k = min(k, seq.spec_k or k)
    return max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens))


def adapt_k(seq: Sequence, proposed: int, accepted: int, k_max: int) -> None:
    """Per-sequence k from its last verification: one more after a clean sweep, else just past the run
    that was accepted, so that a sequence the proposer keeps missing stops paying for long proposals."""
    current = seq.spec_k or k_max
    seq.spec_k = min(k_max, current + 1) if accepted == proposed else max(1, accepted + 1)


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        """Set each sequence's spec_token_ids (at most its limit; fewer or none is fine), and spec_probs."""

    def verified(self, seq: Sequence) -> None:
        """Called once the sequence's accepted tokens are computed and its rejected slots rolled back."""


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n first)
    and propose what followed it."""

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        for seq, k in zip(seqs, limits, strict=True):
            seq.spec_token_ids = ngram_continuation(seq.token_ids, k, self.max_n, self.min_n)
            seq.spec_probs = None

    def verified(self, seq: Sequence) -> None:
        pass


def ngram_continuation(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        first = pattern[0]
        for i in range(length - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == pattern:
                return tokens[i + n : i + n + k]
    return []


class DraftProposer:
    """A smaller model of the same vocabulary proposes k tokens autoregressively.

    Its KV pool has the target's block ids, so each sequence's block table serves both. The draft's KV is
    filled lazily: a sequence's first proposal runs the draft over whatever of the sequence it has not
    seen (the prompt, or tokens decoded without speculation), later ones over the token or two since.
    Full blocks whose draft KV is known good (computed for verified tokens, or loaded from a snapshot)
    are remembered by the hash they were registered under, so a prefix-cache hit skips the draft too.
    """

    def __init__(self, model: Model, blocks: BlockManager, sampler: Sampler) -> None:
        self.runner = ModelRunner(model, blocks.num_blocks, blocks.block_size)
        self.blocks = blocks
        self.sampler = sampler
        self.valid: dict[int, int] = {}  # block -> hash of the verified full block whose draft KV it holds

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        bs = self.blocks.block_size
        chunks = []
        for seq in seqs:
            start = self._known(seq)
            for block in seq.block_table[start // bs :]:  # about to be written
                self.valid.pop(block, None)
            # Prompt tokens as the target computed them (a chunk), generated ones as one-token steps: the draft
            # then rounds as the target did, so a draft equal to the target is always accepted.
            split = min(max(start, seq.num_prompt_tokens), seq.num_tokens - 1)
            prompt_part = [Chunk(seq.block_table, seq.token_ids[start:split], start, 0)] if split > start else []
            chunks.append([*prompt_part, Chunk(seq.block_table, seq.token_ids[split:], split, 1, True)])
            seq.spec_token_ids = []
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:
            logits = self.runner.forward([c for i in active for c in chunks[i]]).cpu()  # the sampler works on the host
            for row, i in enumerate(active):
                seq = seqs[i]
                token, q = self._sample(logits[row], seq)
                seq.spec_token_ids.append(token)
                if q is not None:
                    probs[i].append(q)
                position = seq.num_tokens - 1 + len(seq.spec_token_ids)
                chunks[i] = [Chunk(seq.block_table, [token], position, 1)]
            active = [i for i in active if len(seqs[i].spec_token_ids) < limits[i]]
        for seq, q_rows in zip(seqs, probs, strict=True):
            seq.spec_probs = torch.stack(q_rows) if q_rows else None
            # Draft KV is now written for every position before the last proposal.
            seq.draft_computed = seq.num_tokens - 1 + len(seq.spec_token_ids)

    def verified(self, seq: Sequence) -> None:
        seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
        # Remember the newly completed full blocks, walking back to the first one already remembered.
        for i in range(min(seq.draft_computed // self.blocks.block_size, len(seq.block_hashes)) - 1, -1, -1):
            block = seq.block_table[i]
            if block == Sequence.NO_BLOCK or self.valid.get(block) == seq.block_hashes[i]:
                break
            self.valid[block] = seq.block_hashes[i]

    def loaded(self, blocks: list[int], hashes: list[int], kv: torch.Tensor) -> None:
        """Draft KV of a snapshot prefix for blocks the target's prefix KV was loaded into."""
        self.runner.fill_blocks(blocks, kv)
        self.valid.update(zip(blocks, hashes, strict=True))

    def _known(self, seq: Sequence) -> int:
        """Positions of the sequence whose draft KV is good: its own progress, or a run of valid cached
        blocks from the start (after a prefix hit or a preemption). Blocks a sliding window let go are
        skipped: the draft then attends to less than it would, which costs acceptance, never exactness."""
        bs = self.blocks.block_size
        known = min(seq.draft_computed, seq.num_computed_tokens)
        while known // bs < len(seq.block_table) and seq.block_table[known // bs] == Sequence.NO_BLOCK:
            known = (known // bs + 1) * bs
        i = known // bs
        while (
            i < len(seq.block_hashes)
            and seq.block_table[i] != Sequence.NO_BLOCK
            and self.valid.get(seq.block_table[i]) == seq.block_hashes[i] == self.blocks.block_hash[seq.block_table[i]]
        ):
            i += 1
        return min(max(known, i * bs), seq.num_tokens - 1)

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        if seq.params.greedy:
            return int(logits.argmax()), None
        q = self.sampler.probs(logits[None], [seq.params])
        q = q / q.sum(dim=-1, keepdim=True)
        return int(self.sampler.draw(q, [seq])[0]), q[0]


class Speculation:
    """The engine's use of a proposer: how many slots the scheduler keeps for a decoding sequence's proposals,
    filling them before a step, and after it the verification's bookkeeping and the rollback of rejected slots."""

    def __init__(self, proposer: Proposer, blocks: BlockManager, k: int, adaptive: bool, max_model_len: int) -> None:
        """``k``: proposals verified per sequence and step, at most; ``adaptive``: each sequence's k follows its
        acceptance (adapt_k)."""
        self.proposer = proposer
        self.blocks = blocks
        self.k = k
        self.adaptive = adaptive
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    @property
    def drafts_with_a_model(self) -> bool:
        return isinstance(self.proposer, DraftProposer)

    def lookahead(self, seq: Sequence) -> int:
        # The draft model holds no adapter's KV (adapters are compiled for the target), so requests behind an
        # adapter are verified only by prompt lookup.
        if seq.adapter is not None and self.drafts_with_a_model:
            return 0
        if seq.grammar is not None:  # proposals are not checked against its grammar: it never speculates
            return 0
        return lookahead(seq, self.k, self.max_model_len)

    def propose(self, batch: ScheduledBatch) -> None:
        """Fill the speculative slots the scheduler gave decoding sequences; shrink them to the proposals."""
        seqs, limits, rows = [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            room = n - (seq.num_tokens - seq.num_computed_tokens)
            if room > 0:
                seqs.append(seq)
                limits.append(room)
                rows.append(i)
        if not seqs:
            return
        self.proposer.propose(seqs, limits)
        for seq, i in zip(seqs, rows, strict=True):
            batch.num_tokens[i] = 1 + len(seq.spec_token_ids)

    def settle(self, seq: Sequence, num_tokens: int, num_kept: int) -> None:
        """Count the verification, then roll back: the sequence's KV is good up to its last accepted token
        (a finishing sequence keeps fewer); later slots' blocks go back to the pool."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += len(seq.spec_token_ids)
        self.stats.num_accepted_tokens += num_tokens - 1
        self.stats.num_emitted_tokens += num_tokens
        if self.adaptive:
            adapt_k(seq, len(seq.spec_token_ids), num_tokens - 1, self.k)
        seq.num_computed_tokens += num_kept
        seq.spec_token_ids = []
        seq.spec_probs = None
        self.blocks.commit(seq)
        self.blocks.trim(seq)
        self.proposer.verified(seq)


def speculation_for(
    o: EngineOptions, draft: Model | None, blocks: BlockManager, sampler: Sampler, max_model_len: int
) -> Speculation | None:
    """The engine's speculation as its options ask, or None when they ask for none."""
    proposer: Proposer
    if o.speculative is None:
        return None
    if o.speculative == "ngram":
        proposer = NgramProposer()
    elif draft is None:
        raise ValueError("speculative='draft' needs a draft model (build the snapshot with --draft DIR)")
    else:
        proposer = DraftProposer(draft, blocks, sampler)
    return Speculation(proposer, blocks, o.num_speculative_tokens, o.adaptive_speculation, max_model_len)


def check_draft_compatible(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft proposes token ids the target verifies: both must share one vocabulary."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}; "
            "a draft model must use the target's tokenizer and vocabulary"
        )
