"""Logits processing before sampling, batched over the rows that ask for it (vLLM's semantics and order):

- repetition_penalty (HF/CTRL): a token seen in the prompt or the output has its logit divided by the penalty
  when positive, multiplied when negative;
- frequency_penalty and presence_penalty (OpenAI): minus the penalty times the token's count in the output,
  minus the penalty once if it appears in the output at all;
- logit_bias: added to the named tokens' logits;
- min_tokens: end-of-sequence and stop_token_ids banned until the output has that many tokens;
- bad_words: a banned sequence's last token is banned wherever the output ends with the rest of it.
The bans come first, then logit_bias, then the penalties (on the biased logits).

Each kind is one tensor operation over the rows that use it, on the (row, token) slots their tokens name: the
work grows with the tokens, never with the vocabulary, and Python only lists each row's tokens.
"""

from __future__ import annotations

from array import array

import torch

from warmstart.runtime.engine.sequence import Sequence


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``logits`` [rows, vocab] with each row's sequence's processing applied; the input itself when no
    row asks for any (a new tensor otherwise)."""
    if not any(s.params.processes_logits for s in seqs):
        return logits
    x = logits.clone(memory_format=torch.contiguous_format)  # viewed flat below
    # vLLM's order (v1 Sampler): bans, then logit_bias, then the penalties over the biased logits.
    _bans(x, seqs)
    _logit_bias(x, seqs)
    _repetition(x, seqs)
    _frequency_presence(x, seqs)
    return x


def _token_slots(token_lists: list[tuple[int, list[int]]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of (row, tokens) lists, as flat indexes row * vocab + token into the
    logits, and how many times each occurs. Work in the number of tokens, not the vocabulary."""
    flat = array("q", [row * vocab + t for row, tokens in token_lists for t in tokens])
    if not flat:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    return torch.unique(torch.frombuffer(flat, dtype=torch.long), return_counts=True)


def _per_slot(values: list[float], slots: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Each slot's row's value."""
    return torch.tensor(values, dtype=dtype)[slots // vocab]


def _repetition(x: torch.Tensor, seqs: list[Sequence]) -> None:
    vocab = x.shape[1]
    slots, _ = _token_slots([(i, s.token_ids[s.num_virtual_tokens :]) for i, s in enumerate(seqs)
                             if s.params.repetition_penalty != 1.0], vocab)
    if not len(slots):
        return
    flat = x.view(-1)
    penalty = _per_slot([s.params.repetition_penalty for s in seqs], slots, vocab, x.dtype)
    seen = flat[slots]
    # Divided, not multiplied by 1 / penalty: the same floats as transformers' RepetitionPenaltyLogitsProcessor.
    flat[slots] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _frequency_presence(x: torch.Tensor, seqs: list[Sequence]) -> None:
    vocab = x.shape[1]
    slots, counts = _token_slots([(i, s.output_token_ids) for i, s in enumerate(seqs)
                                  if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0], vocab)
    if not len(slots):
        return
    frequency = _per_slot([s.params.frequency_penalty for s in seqs], slots, vocab, x.dtype)
    presence = _per_slot([s.params.presence_penalty for s in seqs], slots, vocab, x.dtype)
    x.view(-1)[slots] -= frequency * counts.to(x.dtype) + presence


def _logit_bias(x: torch.Tensor, seqs: list[Sequence]) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, s in enumerate(seqs):
        for token, bias in s.params.logit_bias.items():
            row_ids.append(i)
            token_ids.append(token)
            biases.append(bias)
    if row_ids:
        x.index_put_((torch.tensor(row_ids), torch.tensor(token_ids)), torch.tensor(biases, dtype=x.dtype),
                     accumulate=True)


def _bans(x: torch.Tensor, seqs: list[Sequence]) -> None:
    """min_tokens' end tokens and bad_words' completions, set to -inf in one indexing."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            for token in s.min_tokens_banned:
                row_ids.append(i)
                token_ids.append(token)
        for token in _bad_word_completions(s):
            row_ids.append(i)
            token_ids.append(token)
    if row_ids:
        x[torch.tensor(row_ids), torch.tensor(token_ids)] = float("-inf")


def _bad_word_completions(seq: Sequence) -> list[int]:
    """The last token of each banned sequence whose other tokens end the output so far."""
    output = seq.output_token_ids
    banned = []
    for word in seq.params.bad_words_token_ids:
        head = word[:-1]
        if len(head) <= len(output) and (not head or output[len(output) - len(head) :] == head):
            banned.append(word[-1])
    return banned
