"""What a request asks of the sampler, validated up front so a bad field never reaches a batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.structured_outputs import StructuredOutputsParams

# vLLM sets no count limit (it keeps the ids as a set and checks them against the vocabulary); real requests
# send a handful (a model's end-of-turn tokens). 4096 is far above any real use, while checking and hashing
# that many ids costs well under a millisecond per request.
MAX_STOP_TOKEN_IDS = 4096


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (the chosen token is always included)
    include_stop_str_in_output: bool = False
    speculative: bool = True  # False: never speculate for this request, even when the engine does
    # What the output must match (a JSON schema, a regex...): decoded under a grammar (runtime/engine/structured.py).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflow; the limit is the argmax anyway.
        return self.temperature < 1e-5

    def validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}")

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                fail(name, f"must be a number, got {value!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", f"must be -1, 0 (no limit) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            fail("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.speculative, bool):
            fail("speculative", f"must be true or false, got {self.speculative!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", f"must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must hold non-empty strings")
        if not isinstance(self.stop_token_ids, list | tuple | set | frozenset):
            fail("stop_token_ids", f"must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are supported")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must hold non-negative integers")
