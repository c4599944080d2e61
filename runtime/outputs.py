"""What the engine hands back for a request: cumulative results plus what is new since the last output."""

from __future__ import annotations

from dataclasses import dataclass, field

from warmstart.runtime.engine.sequence import Timestamps, TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # their text so far, stop strings applied
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    timestamps: Timestamps | None = None
    adapter: str | None = None  # the adapter that served the request
    index: int = 0  # which of the request's n choices (SamplingParams.n) this output is of
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # SamplingParams.prompt_logprobs; None first


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found there
    num_preemptions: int
    prompt_tokens: int  # prompt tokens computed (not counting cache hits)
    generation_tokens: int
    num_adapters: int = 0  # compiled adapters loaded
    running_adapters: list[str] = field(default_factory=list)  # distinct adapters of running requests
    waiting_adapters: list[str] = field(default_factory=list)
    spec_num_drafts: int = 0  # speculative verification passes
    spec_num_draft_tokens: int = 0  # proposed tokens verified
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0  # accepted plus one target token per pass
    kv_tier: dict[str, float] | None = None  # the KV tier's counters (runtime/engine/kv_tier.py), when it has one

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks
