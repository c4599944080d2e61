"""Constrained decoding: a grammar matcher per request and a token bitmask on its row of the batch's logits.

The grammar engine is llguidance (vLLM's other backend beside xgrammar), picked by measurement: it imports in
about 15 ms and reads the vocabulary straight from tokenizers' JSON, where xgrammar takes 0.7-1.0 s and imports
transformers, which runtime/ never does (see docs/BENCHMARKS.md). It is imported here only, and only when the
first constrained request arrives (``_llguidance``), so an unconstrained server never pays for it.

Each request's matcher is advanced with every token the engine accepts (OutputProcessor.append); before a step samples,
``apply_grammar_masks`` sets to -inf every token its grammar forbids on that request's row only, so constrained
and free requests share every batch. The model's EOS tokens are the grammar's stop tokens: the mask allows them
only where the grammar is complete. Compiled grammars (pristine matchers) are kept by the hash of what was asked
for, and each request gets a copy. Speculative proposals are never verified against a grammar: a constrained
request does not speculate (LLMEngine._lookahead).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from warmstart.runtime.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from warmstart.runtime.tokenizer import Tokenizer

CACHED_GRAMMARS = 256  # compiled grammars kept per tokenizer, least recently used dropped first
# JSON without free whitespace: the key and item separators are fixed (as json.dumps writes them), so a model
# cannot loop on spaces or newlines until max_tokens (a known failure of small models under any-whitespace JSON).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# What one request's grammar may cost the step it shares (llguidance's ParserLimits; its defaults but the first).
# The lexer's initial fuel at 100k in place of 1M: a regex like (x{1000}){1000} took 0.95-1.6 s to its first mask,
# in the engine's step, stalling every stream; with it, 0.03-0.04 s, and it is then refused as the lexer errors.
# JSON schemas of 60 fields, dates, e-mails and IP addresses took under 2 ms at either setting (measured here).
INITIAL_LEXER_FUEL = 100_000


def _limits() -> Any:
    return _llguidance().LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL)


class GrammarError(ValueError):
    """What a request asked its output to match cannot be compiled; the message says why."""


def _llguidance() -> Any:
    import llguidance

    return llguidance


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``spec``."""
    llg = _llguidance()
    kind = spec.kind()
    if kind == "json":
        return str(llg.LLMatcher.grammar_from_json_schema(spec.schema(), defaults=JSON_OPTIONS))
    if kind == "json_object":
        return str(llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))
    if kind == "regex":
        return str(llg.LLMatcher.grammar_from_regex(spec.regex))
    if kind == "choice":
        import json

        assert spec.choice is not None
        # One lexeme (a terminal) rather than one parser rule per choice: llguidance's parser holds at most 2,000
        # items a row, and a list past that errored at the first token (the request then ended, unmatched)
        return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    return str(llg.LLMatcher.grammar_from_lark(spec.grammar))


def check_grammar(spec: StructuredOutputsParams) -> None:
    """Raise GrammarError naming what is wrong with ``spec`` (no tokenizer needed): for a server's 400."""
    try:
        source = grammar_source(spec)
    except ValueError as e:
        raise GrammarError(f"{_what(spec)} is invalid: {e}") from None
    error = _llguidance().LLMatcher.validate_grammar(source, limits=_limits())
    if error:
        raise GrammarError(f"{_what(spec)} is invalid: {error.strip()}")


def _what(spec: StructuredOutputsParams) -> str:
    return {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
            "choice": "the choice list", "grammar": "the grammar"}[spec.kind()]


@dataclass
class CompileStats:
    compiled: int = 0
    cache_hits: int = 0
    seconds: float = 0.0  # spent compiling (misses only)


class GrammarCompiler:
    """Compiles grammars against one tokenizer and vocabulary, and keeps them by ``spec.key()``."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos_token_ids)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """A pristine llguidance matcher for ``spec`` (copy it before use); raises GrammarError. Its first mask is
        computed here too, on a copy: the lexer's states, which the copies share, are built where compile runs (off
        the engine's step for AsyncLLM), and a grammar that is past the limits at once is refused here."""
        import time

        key = spec.key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                self.stats.cache_hits += 1
                return self._compiled[key]
        start = time.perf_counter()
        try:
            source = grammar_source(spec)
        except ValueError as e:
            raise GrammarError(f"{_what(spec)} is invalid: {e}") from None
        matcher = _llguidance().LLMatcher(self.tokenizer, source, log_level=0, limits=_limits())
        if not matcher.is_error():
            first = matcher.deep_copy()
            mask = torch.zeros(-(-self.vocab_size // 32), dtype=torch.int32)
            first.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
            if first.is_error():
                raise GrammarError(f"{_what(spec)} is too complex for the grammar engine's limits: "
                                   f"{first.get_error().strip().splitlines()[0]}")
        if matcher.is_error():
            raise GrammarError(f"{_what(spec)} is invalid: {matcher.get_error().strip()}")
        with self._lock:
            self.stats.compiled += 1
            self.stats.seconds += time.perf_counter() - start
            self._compiled[key] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec).deep_copy(), self.eos_token_ids)


_compilers: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, tuple[int, ...]], GrammarCompiler]] = (
    weakref.WeakKeyDictionary()
)
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> GrammarCompiler:
    """The compiler (and its cache) for a tokenizer, the model's vocabulary size and its EOS tokens."""
    key = (vocab_size, tuple(sorted(eos_token_ids)))
    with _compilers_lock:
        per_tokenizer = _compilers.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            per_tokenizer[key] = GrammarCompiler(tokenizer.hf.to_str(), vocab_size, list(key[1]))
        return per_tokenizer[key]


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, eos_token_ids: list[int]) -> None:
        self._matcher = matcher
        self._eos = eos_token_ids

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; False if the grammar forbids it (the matcher is then in error)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return bool(self._matcher.is_stopped())

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (n > 1: each choice advances its own)."""
        return GrammarMatcher(self._matcher.deep_copy(), self._eos)

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``row`` (int32, one bit per token). A matcher in error (it was
        given a token its mask forbade, which the engine never does) allows only EOS, so the request ends."""
        if self._matcher.is_error():
            row.zero_()
            for t in self._eos:
                row[t // 32] |= _bit(t % 32)
            return
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def _bit(i: int) -> int:
    return -(1 << 31) if i == 31 else 1 << i  # int32: bit 31 is the sign


def apply_grammar_masks(logits: torch.Tensor, grammars: list[GrammarMatcher | None]) -> bool:
    """Set to -inf, row by row in place, the logits of tokens each row's grammar forbids next (row i has
    grammars[i]); rows without one (free requests) are left alone. Returns whether any row was masked."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return False
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)
    for j, i in enumerate(rows):
        grammar = grammars[i]
        assert grammar is not None
        grammar.fill_bitmask(bitmask[j])
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(len(rows), words * 32)[:, :vocab].bool()
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
    return True
