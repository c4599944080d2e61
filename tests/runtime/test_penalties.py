"""Logits processing (runtime/engine/penalties.py): each kind batched over a mixed batch equals a plain per-row
reference (transformers' RepetitionPenaltyLogitsProcessor for repetition_penalty), rows without processing
untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from warmstart.runtime.engine.penalties import adjust_logits
from warmstart.runtime.engine.sequence import Sequence
from warmstart.runtime.sampling_params import SamplingParams

VOCAB = 50


def seq(prompt: list[int], output: list[int], **params: object) -> Sequence:
    s = Sequence("r", prompt + output, len(prompt), SamplingParams(max_tokens=64, **params))  # type: ignore[arg-type]
    s.min_tokens_banned = frozenset({0, 7})
    return s


def logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1)) * 3


def test_repetition_penalty_equals_transformers_over_prompt_and_output() -> None:
    seqs = [seq([1, 2, 3], [3, 4]), seq([5, 9], [9, 9, 11], repetition_penalty=1.3),
            seq([2, 4, 6], [8], repetition_penalty=0.7)]
    x = logits(3)
    got = adjust_logits(x, seqs)
    assert torch.equal(got[0], x[0])
    for i in (1, 2):
        ids = torch.tensor([seqs[i].token_ids])
        want = RepetitionPenaltyLogitsProcessor(seqs[i].params.repetition_penalty)(ids, x[i : i + 1].clone())
        torch.testing.assert_close(got[i], want[0], rtol=0, atol=0)


def test_frequency_and_presence_count_the_output_only() -> None:
    seqs = [seq([4, 4, 4], [1, 1, 2], frequency_penalty=0.5, presence_penalty=1.5), seq([1], [1, 2])]
    x = logits(2)
    got = adjust_logits(x, seqs)
    want = x[0].clone()
    for token in set(seqs[0].output_token_ids):
        count = seqs[0].output_token_ids.count(token)
        want[token] -= 0.5 * count + 1.5
    torch.testing.assert_close(got[0], want)
    assert torch.equal(got[1], x[1])
    assert got[0, 4] == x[0, 4]  # only in the prompt: not penalized


def test_logit_bias_min_tokens_and_bad_words() -> None:
    seqs = [
        seq([1], [3], logit_bias={5: 100.0, 6: -100.0}),
        seq([1], [3, 4], min_tokens=3),
        seq([1], [3, 4, 5], min_tokens=3),  # reached: nothing banned
        seq([1], [3, 4], bad_words_token_ids=[[9], [4, 12], [3, 13], [20, 4, 14]]),
    ]
    x = logits(4)
    got = adjust_logits(x, seqs)
    want = x.clone()
    want[0, 5] += 100.0
    want[0, 6] -= 100.0
    want[1, [0, 7]] = float("-inf")
    want[3, [9, 12]] = float("-inf")  # [3, 13] needs 3 last, [20, 4, 14] needs 20, 4 last
    torch.testing.assert_close(got, want)


def test_no_processing_returns_the_logits_unchanged() -> None:
    x = logits(2)
    assert adjust_logits(x, [seq([1], [2]), seq([3], [])]) is x


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}), ("min_tokens", 65), ("min_tokens", -1),
    ("bad_words_token_ids", [[]]),
])  # fmt: skip
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=64, **{field: value})  # type: ignore[arg-type]
