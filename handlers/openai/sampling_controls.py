"""The sampling controls of an OpenAI/vLLM request body: penalties, logit_bias, min_tokens, bad_words, n and
best_of, checked field by field into SamplingParams' keyword arguments. A bad value raises FieldError naming
the field (handlers.openai.requests turns it into a 400)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warmstart.runtime.tokenizer import Tokenizer

MAX_LOGIT_BIAS = 1024  # OpenAI caps a request at a few hundred biased tokens; this is far above real use
MAX_BAD_WORDS = 128
MAX_CHOICES = 16  # n and best_of: each choice is a sequence in the batch


class FieldError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _number(raw: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = raw.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{name} must be a number, got {value!r}", name)
    if not ((lo < value if lo_open else lo <= value) and value <= hi):  # NaN fails every comparison
        raise FieldError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}", name)
    return float(value)


def _integer(raw: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = raw.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FieldError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def sampling_controls(raw: dict[str, Any], max_tokens: int, vocab_size: int, tokenizer: Tokenizer | None,
                      defaults: dict[str, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """SamplingParams' keyword arguments for the penalties, logit_bias, min_tokens and bad_words of ``raw``.
    ``defaults``: the model's generation_config sampling, whose repetition_penalty a request that leaves it out
    gets (as vLLM's --generation-config auto)."""
    repetition = (defaults or {}).get("repetition_penalty", 1.0)
    return {
        "presence_penalty": _number(raw, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(raw, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(raw, "repetition_penalty", repetition, 0.0, 2.0, lo_open=True),
        "logit_bias": _logit_bias(raw.get("logit_bias"), vocab_size),
        "min_tokens": _integer(raw, "min_tokens", 0, 0, max_tokens),
        "bad_words_token_ids": _bad_words(raw.get("bad_words"), tokenizer),
    }


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FieldError("logit_bias must be an object mapping token ids to biases in [-100, 100]", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise FieldError(f"logit_bias holds {len(value)} tokens; at most {MAX_LOGIT_BIAS} are supported", "logit_bias")
    bias = {}
    for key, b in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if token is None or token >= vocab_size:
            raise FieldError(f"logit_bias key {str(key)[:40]!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise FieldError(f"logit_bias[{key!r}] must be a number in [-100, 100], got {b!r}", "logit_bias")
        bias[token] = float(b)
    return bias


def _bad_words(value: Any, tokenizer: Tokenizer | None) -> list[list[int]]:
    """Each word's token ids as written and after a space, as vLLM bans them (SamplingParams.
    update_from_tokenizer: the spaced form only when it differs at its first token and has as many tokens)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(w, str) and w for w in value):
        raise FieldError("bad_words must be an array of non-empty strings", "bad_words")
    if len(value) > MAX_BAD_WORDS:
        raise FieldError(f"bad_words holds {len(value)} strings; at most {MAX_BAD_WORDS} are supported", "bad_words")
    if value and tokenizer is None:
        raise FieldError("bad_words needs the model's tokenizer, which this model does not have", "bad_words")
    banned: list[list[int]] = []
    for word in value:
        assert tokenizer is not None
        plain = tokenizer.encode(word, add_special_tokens=False)
        if plain:
            banned.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            banned.append(spaced)
    return banned


def choices(raw: dict[str, Any], stream: bool, chat: bool) -> tuple[int, int]:
    """(n, best_of): how many choices are returned, and how many are generated to pick them from (best_of is
    a completions field: chat has none, as in OpenAI's API)."""
    n = _integer(raw, "n", 1, 1, MAX_CHOICES)
    best_of = n if chat else _integer(raw, "best_of", n, 1, MAX_CHOICES)
    if best_of < n:
        raise FieldError(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and stream:
        raise FieldError("best_of greater than n cannot be streamed (the best are known only at the end); "
                         "set stream to false", "best_of")
    return n, best_of
