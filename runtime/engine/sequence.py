"""One request as the engine sees it: its tokens, how many are computed, and the KV blocks that hold them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from warmstart.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from warmstart.runtime.engine.structured import GrammarMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Timestamps:
    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-n alternatives, from the model's raw distribution."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None  # the chosen token's 1-based rank in the vocabulary, where computed (prompt logprobs)


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    status: Status = Status.WAITING
    # params.stop_token_ids as a set, fixed at admission: checked for every generated token.
    stop_token_ids: frozenset[int] = frozenset()
    # What params.min_tokens bans until reached: the stop token ids and (unless ignore_eos) the model's EOS.
    min_tokens_banned: frozenset[int] = frozenset()
    num_computed_tokens: int = 0
    # Block ids in position order; NO_BLOCK where a sliding window let the block go.
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks computed so far (parents of the next one).
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    generator: torch.Generator | None = None
    timestamps: Timestamps = field(default_factory=lambda: Timestamps(time.monotonic()))
    num_preemptions: int = 0
    # An adapter's virtual tokens lead token_ids (see runtime/engine/adapters.py); they are never computed, only
    # served: full blocks by the prefix cache, the partial tail copied from ``virtual_tail_block``.
    adapter: str | None = None
    num_virtual_tokens: int = 0
    virtual_tail_block: int | None = None
    # A LoRA adapter's name (runtime/engine/lora.py; ``adapter`` names it too), and the root its KV blocks' chained
    # hashes start from in the prefix cache: 0 (the block manager's NO_PARENT) for the base model.
    lora: str | None = None
    hash_root: int = 0
    # Speculative decoding: proposed tokens to verify this step (not yet in token_ids), the draft model's
    # distributions they were drawn from ([k, vocab]; None for prompt lookup, a point mass), and how many
    # positions of the draft model's KV are valid in this sequence's blocks.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    draft_computed: int = 0
    spec_k: int | None = None  # this sequence's own number of proposals, when adapted to its acceptance
    # Structured outputs: the request's position in its grammar, which masks its logits (runtime/engine/structured.py).
    grammar: GrammarMatcher | None = None
    # n > 1: choice ``index`` of request ``choice_of``. Choices 1.. wait in the first one's ``forks`` (out of the
    # scheduler, ``forked_from`` set) until its prompt is computed; then they sample their first token from
    # the same logits and share its KV blocks (LLMEngine._fork).
    index: int = 0
    choice_of: str | None = None
    forks: list[Sequence] = field(default_factory=list)
    forked_from: Sequence | None = None
    # params.prompt_logprobs: one entry per prompt token (after virtual ones), None for the first
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    NO_BLOCK = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as the request gave it, without an adapter's virtual tokens."""
        return self.token_ids[self.num_virtual_tokens : self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
