"""transformers as the reference: greedy continuations and the near-tie rule for random weights."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from warmstart.runtime.outputs import RequestOutput


@functools.cache
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.cache
def _greedy(model_dir: Path, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    return list(_greedy(model_dir, tuple(prompt), max_tokens))


def top2_gap(model_dir: Path, token_ids: list[int]) -> float:
    """Difference between the reference's two largest next-token logits after ``token_ids``."""
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([token_ids])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_matches_reference(model_dir: Path, prompt: list[int], ours: list[int], max_tokens: int) -> None:
    """Our greedy tokens equal the reference's, or first differ where the reference is within 1e-3 of a tie."""
    ref = hf_greedy(model_dir, prompt, max_tokens)
    assert len(ours) == len(ref) == max_tokens, (len(ours), len(ref))
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            gap = top2_gap(model_dir, prompt + ref[:i])
            assert gap < 1e-3, (
                f"prompt of {len(prompt)} tokens: token {i} is {a}, reference {b}, "
                f"and the reference's top-2 gap is {gap:.2e} (not a near-tie)"
            )
            return


def assert_close_in_bf16(
    ours: list[RequestOutput], reference: list[RequestOutput], same_prefix: int = 4, logprob_tol: float = 0.05
) -> None:
    """bf16 outputs of a kernel path against the PyTorch path (RequestOutputs with logprobs): the first
    ``same_prefix`` tokens agree, and each token's logprob agrees within ``logprob_tol`` until the first
    difference (bf16 sums in another order may part later)."""
    for a, b in zip(ours, reference, strict=True):
        assert a.token_ids[:same_prefix] == b.token_ids[:same_prefix]
        assert a.logprobs is not None and b.logprobs is not None
        for token_a, token_b, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True):
            if token_a != token_b:
                break
            assert abs(la.logprob - lb.logprob) < logprob_tol
