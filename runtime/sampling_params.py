"""What a request asks of the sampler, validated up front so a bad field never reaches a batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from warmstart.runtime.structured_outputs import StructuredOutputsParams

# vLLM sets no count limit (it keeps the ids as a set and checks them against the vocabulary); real requests
# send a handful (a model's end-of-turn tokens). 4096 is far above any real use, while checking and hashing
# that many ids costs well under a millisecond per request.
MAX_STOP_TOKEN_IDS = 4096
MAX_N = 64  # choices per request: each is a sequence of the batch


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
    # False: the text keeps special tokens (those that end the request excepted), as vLLM's field of that name;
    # the Mistral tool-call parser reads calls after its [TOOL_CALLS] token.
    skip_special_tokens: bool = True
    speculative: bool = True  # False: never speculate for this request, even when the engine does
    # What the output must match (a JSON schema, a regex...): decoded under a grammar (runtime/engine/structured.py).
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1  # choices generated from the prompt, computed once (see LLMEngine.add_request)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (runtime/engine/prompt_logprobs.py)
    # Logits processing (runtime/engine/penalties.py, vLLM's semantics).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM's cache_salt: the request's KV chain starts from this salt, so it shares cached blocks (and KV tier
    # segments) only with requests of the same salt, and none with unsalted ones (snapshot prefixes included)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (which depends on the tokens before each position, so
        such a request is never speculated: see speculative.lookahead)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflow; the limit is the argmax anyway.
        return self.temperature < 1e-5

    def validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                fail(name, f"must be a number, got {value!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            fail("cache_salt", f"must be a non-empty string or None, got {self.cache_salt!r}")
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
        if not isinstance(self.skip_special_tokens, bool):
            fail("skip_special_tokens", f"must be true or false, got {self.skip_special_tokens!r}")
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
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            fail("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
            and 0 <= self.prompt_logprobs <= 20
        ):  # fmt: skip
            fail("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        self._validate_processing(fail)

    def _validate_processing(self, fail: Callable[[str, str], None]) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                fail(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, dict) or any(
            not isinstance(t, int) or t < 0 or isinstance(b, bool) or not isinstance(b, int | float)
            or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()
        ):  # fmt: skip
            fail("logit_bias", "must map non-negative token ids to numbers in [-100, 100]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            fail("min_tokens", f"({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if not isinstance(self.bad_words_token_ids, list) or any(
            not isinstance(w, list) or not w or any(not isinstance(t, int) or t < 0 for t in w)
            for w in self.bad_words_token_ids
        ):  # fmt: skip
            fail("bad_words_token_ids", "must be a list of non-empty lists of non-negative token ids")
