"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs; completions' echo with logprobs): each prompt token's
logprob under the model given the tokens before it, and the top-n there. The first prompt token has none.

A request that asks for them computes logits at every prompt position, so its prompt is never served from the
prefix cache (as in vLLM): a cached position has no logits (BlockManager.start).
"""

from __future__ import annotations

import torch

from warmstart.runtime.engine.sequence import Sequence, TokenLogprobs


def wants_prompt_logits(seq: Sequence, start: int) -> bool:
    """Whether a chunk of ``seq`` from position ``start`` needs logits at every position."""
    return seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens and not seq.spec_token_ids


def record_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """Record what ``logits`` (row j: position start + j, predicting the token after it) say of the prompt
    tokens that follow; positions recomputed after a preemption are not recorded twice."""
    top_n = seq.params.prompt_logprobs
    assert top_n is not None
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first prompt token: nothing before it to predict it
    # Token k of the real prompt (after an adapter's virtual tokens) is predicted at position num_virtual + k - 1.
    known, virtual, end = len(seq.prompt_logprobs), seq.num_virtual_tokens, seq.num_prompt_tokens
    rows = [j for j in range(logits.shape[0]) if start + j + 1 - virtual >= known and start + j + 1 < end]
    if not rows:
        return
    targets = [seq.token_ids[start + j + 1] for j in rows]
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen_lp = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
    chosen = chosen_lp[:, 0].tolist()
    ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()  # vLLM's rank: 1 + the tokens more likely
    top_vals, top_ids = lp.topk(top_n, dim=-1) if top_n else (lp[:, :0], lp[:, :0].long())
    for k, token in enumerate(targets):
        top = dict(zip(top_ids[k].tolist(), top_vals[k].tolist(), strict=True))
        seq.prompt_logprobs.append(TokenLogprobs(token, chosen[k], top, ranks[k]))
