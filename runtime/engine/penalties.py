"""Logits processing before sampling, batched over the rows that ask for it (vLLM's semantics and order):

- repetition_penalty (HF/CTRL): a token seen in the prompt or the output has its logit divided by the penalty
  when positive, multiplied when negative;
- frequency_penalty and presence_penalty (OpenAI): minus the penalty times the token's count in the output,
  minus the penalty once if it appears in the output at all;
- logit_bias: added to the named tokens' logits;
- min_tokens: end-of-sequence and stop_token_ids banned until the output has that many tokens;
- bad_words: a banned sequence's last token is banned wherever the output ends with the rest of it.
The bans come first, then logit_bias, then the penalties (on the biased logits).

Each kind is one tensor operation over the rows that use it; Python only walks each row's token lists (to
build the padded index tensors), never the vocabulary.
"""

from __future__ import annotations

import torch

from runtime.engine.sequence import Sequence


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``logits`` [rows, vocab] with each row's sequence's processing applied; the input itself when no
    row asks for any (a new tensor otherwise)."""
    if not any(s.params.processes_logits for s in seqs):
        return logits
    x = logits.clone()
    # vLLM's order (v1 Sampler): bans, then logit_bias, then the penalties over the biased logits.
    _bans(x, seqs)
    _logit_bias(x, seqs)
    _repetition(x, seqs)
    _frequency_presence(x, seqs)
    return x


def _rows_where(wanted: list[bool]) -> list[int]:
    return [i for i, w in enumerate(wanted) if w]


def _occurrence_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(token_lists), vocab]: how many times each token appears in each list."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1)  # the extra column takes the padding
    if width:
        ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for i, tokens in enumerate(token_lists):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        counts.scatter_add_(1, ids, torch.ones(ids.shape))
    return counts[:, :vocab]


def _repetition(x: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = _rows_where([s.params.repetition_penalty != 1.0 for s in seqs])
    if not rows:
        return
    seen = _occurrence_counts([seqs[i].token_ids[seqs[i].num_virtual_tokens :] for i in rows], x.shape[1]) > 0
    penalty = torch.tensor([seqs[i].params.repetition_penalty for i in rows], dtype=x.dtype)[:, None]
    sub = x[rows]
    penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
    x[rows] = torch.where(seen, penalized, sub)


def _frequency_presence(x: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = _rows_where([s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0 for s in seqs])
    if not rows:
        return
    counts = _occurrence_counts([seqs[i].output_token_ids for i in rows], x.shape[1]).to(x.dtype)
    frequency = torch.tensor([seqs[i].params.frequency_penalty for i in rows], dtype=x.dtype)[:, None]
    presence = torch.tensor([seqs[i].params.presence_penalty for i in rows], dtype=x.dtype)[:, None]
    x[rows] -= frequency * counts + presence * (counts > 0).to(x.dtype)


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
