"""Verifying speculative proposals: which of a sequence's proposed tokens the target keeps.

The accept/resample rule (Leviathan et al. 2023, Chen et al. 2023) keeps proposal j with probability
min(1, p(d) / q(d)) and otherwise samples from the normalized positive part of p - q, so every emitted
token is distributed exactly as the target's sample would be; a proposal from prompt lookup is a point
mass (q(d) = 1). Greedy requests accept a proposal iff it is the target's argmax, so their output is
identical to decoding without speculation. The proposers are in runtime/engine/speculative.py.
"""

from __future__ import annotations

import torch

from warmstart.runtime.engine.sampler import Sampler
from warmstart.runtime.engine.sequence import Sequence, TokenLogprobs


def verify(sampler: Sampler, logits: torch.Tensor, seq: Sequence) -> tuple[list[int], list[TokenLogprobs | None]]:
    """``logits`` [k + 1, vocab]: the target after the sequence's last token and each of its k proposals.
    Returns the accepted proposals plus one token from the target, with their logprobs."""
    params = seq.params
    drafts = seq.spec_token_ids
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        m = 0
        while m < len(drafts) and drafts[m] == best[m]:
            m += 1
        tokens = drafts[:m] + [best[m]]
    else:
        p = sampler.probs(logits, [params] * len(logits))
        tokens = accept(sampler, p / p.sum(dim=-1, keepdim=True), drafts, seq.spec_probs, seq)
    return tokens, sampler.logprobs(logits[: len(tokens)], tokens, [params] * len(tokens))


def accept(
    sampler: Sampler, p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, seq: Sequence
) -> list[int]:
    """The accept/resample rule. p: [k + 1, vocab] target probabilities; q: [k, vocab] the draft's (None:
    point masses on the drafts). Randomness comes from the request's generator when it has a seed."""
    k = len(drafts)
    index = torch.tensor(drafts)
    p_draft = p[torch.arange(k), index].tolist()
    q_draft = q[torch.arange(k), index].tolist() if q is not None else [1.0] * k
    uniforms = sampler.uniform(seq, k)
    for j in range(k):
        if uniforms[j] * q_draft[j] < p_draft[j]:  # u < p/q without dividing by a tiny q
            continue
        if q is not None:
            residual = (p[j] - q[j]).clamp_min(0.0)
        else:
            residual = p[j].clone()
            residual[drafts[j]] = 0.0
        if float(residual.sum()) <= 0.0:  # p == q: a rejection had probability 0; rounding got here
            residual = p[j]
        return drafts[:j] + [int(sampler.draw(residual[None], [seq])[0])]
    return drafts + [int(sampler.draw(p[k][None], [seq])[0])]
