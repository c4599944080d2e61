"""Output processing: the live requests, each choice's sampled tokens appended one by one (detokenized
incrementally, checked against stop strings, stop and EOS ids, the grammar and the length limits) and turned into
RequestOutputs; a request with n > 1 is fanned out into its choices here and each reported under its own index."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from warmstart.runtime.engine.sequence import Sequence, Timestamps, TokenLogprobs
from warmstart.runtime.outputs import RequestOutput
from warmstart.runtime.tokenizer import Detokenizer, Tokenizer


@dataclass
class NewTokens:
    """What one step added to a choice: the tokens kept (up to the first that finishes it) and their text."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stopped_by_string: bool = False  # a stop string ended it: the detokenizer's held-back text is dropped


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int], max_model_len: int) -> None:
        """``eos_token_ids``: the engine's own, read as they grow."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # request id (a choice's: "id#k") -> the choice's sequence and its detokenizer (None without a tokenizer)
        self.requests: dict[str, tuple[Sequence, Detokenizer | None]] = {}
        self.generation_tokens = 0

    def add(self, seq: Sequence) -> None:
        """Track a new request's sequence and, for n > 1, its other choices (see _choices)."""
        params = seq.params
        for choice in [seq, *self._choices(seq)]:
            detok = None
            if self.tokenizer is not None:
                ends = seq.stop_token_ids | (frozenset() if params.ignore_eos else self.eos_token_ids)
                detok = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                    seq.prompt_token_ids, params.skip_special_tokens, ends)
            self.requests[choice.request_id] = (choice, detok)

    def _choices(self, seq: Sequence) -> list[Sequence]:
        """For n > 1: choices 1..n-1 of ``seq``'s request, waiting in seq.forks for its prompt to be computed.
        Each draws from its own generator: seed + index when the request has a seed."""
        p = seq.params
        if p.n == 1:
            return []
        seq.choice_of = seq.request_id
        for k in range(1, p.n):
            child = Sequence(f"{seq.request_id}#{k}", list(seq.token_ids), seq.num_prompt_tokens, p,
                             stop_token_ids=seq.stop_token_ids, min_tokens_banned=seq.min_tokens_banned,
                             timestamps=Timestamps(seq.timestamps.arrival), adapter=seq.adapter,
                             num_virtual_tokens=seq.num_virtual_tokens, virtual_tail_block=seq.virtual_tail_block,
                             lora=seq.lora, hash_root=seq.hash_root, index=k, choice_of=seq.request_id,
                             forked_from=seq)
            if p.seed is not None:
                child.generator = torch.Generator().manual_seed((p.seed + k) % 2**64)
            if seq.grammar is not None:  # structured outputs: each choice advances its own matcher
                child.grammar = seq.grammar.fork()
            seq.forks.append(child)
        return seq.forks

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None], now: float) -> NewTokens:
        """Append a sequence's new tokens one by one, up to the first that finishes it."""
        detok = self.requests[seq.request_id][1]
        new = NewTokens()
        for token, lp in zip(tokens, logprobs, strict=True):
            seq.token_ids.append(token)
            new.token_ids.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            self.generation_tokens += 1
            if lp is not None:
                seq.logprobs.append(lp)
            if seq.timestamps.first_token is None:
                seq.timestamps.first_token = now
            delta = detok.add(token) if detok else None
            new.stopped_by_string = delta is not None and delta.stopped
            new.finish_reason = "stop" if new.stopped_by_string else self._finish_reason(seq, token)
            new.text += delta.text if delta else ""
            if new.finish_reason is not None:
                break
        return new

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in seq.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.grammar is not None and seq.grammar.finished:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def output(self, seq: Sequence, new: NewTokens) -> RequestOutput:
        """The choice's output after ``new``; a finished choice is forgotten, and the text its detokenizer held back
        (a possible stop string's start) is released unless a stop string ended it."""
        detok = self.requests[seq.request_id][1]
        if new.finish_reason is not None:
            del self.requests[seq.request_id]
            if detok is not None and not new.stopped_by_string:
                new.text += detok.flush()
        text = detok.text[: detok.emitted] if detok is not None else ""
        return RequestOutput(
            request_id=seq.choice_of or seq.request_id,
            index=seq.index,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            cached_tokens=max(0, seq.num_cached_tokens - seq.num_virtual_tokens),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            new_token_ids=new.token_ids,
            new_text=new.text,
            timestamps=seq.timestamps,
            adapter=seq.adapter,
        )
