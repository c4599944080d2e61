"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

A random draw inverts each row's CDF at one uniform number (see ``inverse_cdf``: every token keeps its share
to float32 precision, even at probability 1e-9), which samples from p and lets each seeded request draw
from its own generator: the same seed gives the same tokens whatever else shares the batch. It replaced the
exponential race (argmax of p / E, E ~ Exp(1)), which draws a random number per vocabulary entry:
docs/BENCHMARKS.md ("Sampling") measured it 47x slower, 44.1 against 0.93 ms for 40 rows of a 49k vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warmstart.runtime.engine.penalties import adjust_logits
from warmstart.runtime.engine.sequence import Sequence, TokenLogprobs
from warmstart.runtime.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row; the logprobs are the model's own, before penalties and biases (vLLM's default)."""
        params = [s.params for s in seqs]
        adjusted = adjust_logits(logits, seqs)
        tokens = adjusted.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            sampled_seqs = [seqs[i] for i in sampled_rows]
            tokens[rows] = self.draw(self.probs(adjusted[rows], [p.params for p in sampled_seqs]), sampled_seqs)
        token_list: list[int] = tokens.tolist()
        return token_list, self.logprobs(logits, token_list, params)

    def logprobs(
        self, logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]
    ) -> list[TokenLogprobs | None]:
        """Each chosen token's logprob and the top-n, for the rows whose request asked for logprobs."""
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            rows = torch.tensor(wanted)
            lp = torch.log_softmax(logits[rows], dim=-1)
            chosen = lp.gather(1, torch.tensor([tokens[i] for i in wanted])[:, None])[:, 0].tolist()
            top_n = max(params[i].logprobs or 0 for i in wanted)
            top_vals, top_ids = lp.topk(top_n, dim=-1) if top_n else (lp[:, :0], lp[:, :0].long())
            for j, i in enumerate(wanted):
                n = params[i].logprobs or 0
                top = dict(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True))
                logprobs[i] = TokenLogprobs(tokens[i], chosen[j], top)
        return logprobs

    @staticmethod
    def probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k, top-p and min-p applied."""
        x = logits / torch.tensor([p.temperature for p in params])[:, None]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else x.shape[1] for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        if (top_k < x.shape[1]).any() or (top_p < 1.0).any():
            x = _apply_top_k_top_p(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([p.min_p for p in params])
        if (min_p > 0).any():
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row from (unnormalized) ``probs``, row i with seqs[i]'s generator if it has one."""
        u = torch.empty(len(seqs), 1, dtype=torch.float64)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), 1, generator=self.generator, dtype=torch.float64)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                u[i] = torch.rand(1, generator=s.generator, dtype=torch.float64)
        return inverse_cdf(probs, u)

    def uniform(self, seq: Sequence, n: int) -> list[float]:
        """``n`` draws from U[0, 1), from the request's own generator if it has one."""
        return torch.rand(n, generator=seq.generator or self.generator).tolist()


# Tokens per chunk of the two-level inverse CDF below.
CDF_CHUNK = 1024


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative (unnormalized) mass exceeds u[i] times the row's total, for
    u [rows, 1] in [0, 1). A token of zero mass is never chosen.

    In two levels: the chunk of ``CDF_CHUNK`` tokens holding the point, by a float64 cumulative sum of the
    chunks' masses, then the token at the same fraction of that chunk's float64 cumulative sum. Each token's
    share is then right to the float32 rounding of its chunk's sum, a relative error of about 1e-7 (the
    probabilities themselves are float32), however small the token's probability. docs/BENCHMARKS.md: 0.93
    against 6.86 ms for one float64 cumulative sum over the whole row (40 rows of 49k tokens)."""
    rows, vocab = probs.shape
    chunk = min(CDF_CHUNK, vocab)
    padded = (F.pad(probs, (0, -vocab % chunk)) if vocab % chunk else probs).view(rows, -1, chunk)
    mass = padded.sum(dim=-1).double()  # [rows, chunks]
    cdf = mass.cumsum(dim=-1)
    target = u * cdf[:, -1:]
    # The chunk: the first whose cumulative mass exceeds the target, at most the last that has mass (u * total
    # can round up to the total itself).
    c = torch.minimum(torch.searchsorted(cdf, target, right=True), _last_positive(mass))
    fraction = ((target - (cdf.gather(1, c) - mass.gather(1, c))) / mass.gather(1, c)).clamp_(0.0, 1.0)
    inner = padded[torch.arange(rows)[:, None], c][:, 0].double()  # [rows, chunk]
    inner_cdf = inner.cumsum(dim=-1)
    i = torch.minimum(torch.searchsorted(inner_cdf, fraction * inner_cdf[:, -1:], right=True), _last_positive(inner))
    return (c * chunk + i)[:, 0]


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> [rows, 1]: the index of each row's last positive entry (0 if none)."""
    positive = x > 0
    return (x.shape[1] - 1 - positive.flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)).clamp_(min=0)


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every logit outside each row's top-k and its smallest top-p nucleus."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(x.shape[1])[None, :]
    drop = ranks >= top_k[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    nucleus = torch.where(top_p < 1.0, top_p, 2.0)  # no rounding-error cut when top-p is off
    drop |= (mass_before >= nucleus[:, None]) & (ranks > 0)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
