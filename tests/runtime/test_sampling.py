"""Sampling: greedy, temperature, top-k / top-p / min-p, per-request seeds and logprobs.

The Sampler is tested on hand-made logits (so the allowed tokens and the target distribution are known)
and through LLM on a tiny random model (seeds reproduce whatever shares the batch, preemption included).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.engine.sampler import Sampler
from warmstart.runtime.engine.sequence import Sequence, TokenLogprobs

ModelDir = Callable[[str], pathlib.Path]

# Chi-square critical value for 7 degrees of freedom at p = 1e-4 (8 categories).
CHI2_CRIT_7DF = 29.9


def make_seqs(params: list[SamplingParams]) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", [0], 1, p)
        if p.seed is not None:
            s.generator = torch.Generator().manual_seed(p.seed)
        seqs.append(s)
    return seqs


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0) -> list[int]:
    tokens, _ = Sampler(seed)(logits.clone(), make_seqs(params))
    return tokens


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


# Eight logits in a scrambled order, so nothing below depends on the index order.
LOGITS8 = torch.tensor([0.5, 2.0, -1.0, 1.0, -0.5, 3.0, 0.0, 2.5])


# -- greedy and the distribution ---------------------------------------------------------------------------


def test_greedy_equals_argmax_also_next_to_sampled_rows() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 100, generator=g) * 3
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.5)  # filters do not matter
    params = [greedy if i % 3 else SamplingParams(temperature=1.5) for i in range(24)]
    tokens = sample(logits, params)
    argmax = logits.argmax(dim=-1).tolist()
    for i in range(24):
        if i % 3:
            assert tokens[i] == argmax[i], f"row {i}"
    assert any(tokens[i] != argmax[i] for i in range(0, 24, 3))  # the sampled rows do sample


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_empirical_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    n = 6000
    tokens = sample(LOGITS8.expand(n, 8), [SamplingParams(temperature=temperature)] * n, seed=1)
    target = torch.softmax(LOGITS8 / temperature, dim=-1)
    assert chi_square(tokens, target) < CHI2_CRIT_7DF
    # The same statistic rejects the distributions of nearby temperatures, so the check has teeth.
    for wrong in (temperature * 0.8, temperature * 1.25):
        assert chi_square(tokens, torch.softmax(LOGITS8 / wrong, dim=-1)) > CHI2_CRIT_7DF


def test_seeded_rows_follow_the_same_distribution() -> None:
    n = 4000
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(n)]
    tokens = sample(LOGITS8.expand(n, 8), params)
    assert chi_square(tokens, torch.softmax(LOGITS8 / 0.8, dim=-1)) < CHI2_CRIT_7DF
    assert chi_square(tokens, torch.softmax(LOGITS8, dim=-1)) > CHI2_CRIT_7DF


# -- top-k / top-p / min-p -----------------------------------------------------------------------------------


def allowed_top_p(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p (the first token always)."""
    order = probs.argsort(descending=True).tolist()
    allowed: set[int] = set()
    mass = 0.0
    for t in order:
        if allowed and mass >= top_p:
            break
        assert abs(mass - top_p) > 1e-3, "test logits too close to the top-p boundary"
        allowed.add(t)
        mass += float(probs[t])
    return allowed


def allowed_for(p: SamplingParams) -> set[int]:
    x = LOGITS8 / p.temperature
    allowed = set(range(8))
    if p.top_k > 0:
        allowed &= set(x.topk(p.top_k).indices.tolist())
    masked = torch.full_like(x, float("-inf"))
    idx = torch.tensor(sorted(allowed))
    masked[idx] = x[idx]
    if p.top_p < 1.0:
        allowed &= allowed_top_p(torch.softmax(masked, -1), p.top_p)
        masked = torch.full_like(x, float("-inf"))
        idx = torch.tensor(sorted(allowed))
        masked[idx] = x[idx]
    probs = torch.softmax(masked, -1)
    if p.min_p > 0:
        threshold = p.min_p * float(probs.max())
        assert all(abs(float(q) - threshold) > 1e-4 for q in probs), "test logits too close to min-p"
        allowed &= {t for t in range(8) if float(probs[t]) >= threshold}
    return allowed


FILTERS = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=3),
    SamplingParams(top_k=3, temperature=3.0),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.6),
    SamplingParams(top_p=0.8),
    SamplingParams(top_p=0.8, temperature=0.5),
    SamplingParams(top_p=0.01),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.3, temperature=2.0),
    SamplingParams(top_k=4, top_p=0.9, min_p=0.2),
    SamplingParams(top_k=-1, top_p=1.0, min_p=0.0),  # no filter at all
]


def test_top_k_top_p_min_p_never_emit_excluded_tokens_in_a_mixed_batch() -> None:
    rows = 400
    params = [p for p in FILTERS for _ in range(rows)]  # every filter in one call, rows interleaved below
    order = torch.randperm(len(params), generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = [params[i] for i in order]
    tokens = sample(LOGITS8.expand(len(params), 8), shuffled)
    by_filter: dict[int, list[int]] = {i: [] for i in range(len(FILTERS))}
    for pos, i in enumerate(order):
        by_filter[i // rows].append(tokens[pos])
    for f, p in enumerate(FILTERS):
        allowed = allowed_for(p)
        seen = set(by_filter[f])
        assert seen <= allowed, f"{p}: emitted excluded tokens {seen - allowed}"
        # Nothing allowed is cut either: every allowed token likely enough to show up does.
        x = torch.full((8,), float("-inf"))
        idx = torch.tensor(sorted(allowed))
        x[idx] = LOGITS8[idx] / p.temperature
        likely = {t for t in allowed if float(torch.softmax(x, -1)[t]) * rows > 10}
        assert likely <= seen, f"{p}: never emitted allowed tokens {likely - seen}"
    assert [len(allowed_for(p)) for p in FILTERS[3:6]] == [2, 2, 3]  # real cuts, at different places


def test_filters_are_per_row() -> None:
    """A strict filter on one row does not leak into its neighbour's sampling."""
    n = 2000
    params = [SamplingParams(top_k=1) if i % 2 else SamplingParams() for i in range(n)]
    tokens = sample(LOGITS8.expand(n, 8), params)
    assert set(tokens[1::2]) == {int(LOGITS8.argmax())}
    assert len(set(tokens[0::2])) == 8


# -- seeds -----------------------------------------------------------------------------------------------------


def test_seeded_row_reproduces_alone_and_in_any_batch() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3)) * 2
    target = SamplingParams(temperature=1.0, seed=42)
    alone_seq = make_seqs([target])
    s1 = Sampler(seed=0)
    alone = [s1(logits[None].clone(), alone_seq)[0][0] for _ in range(30)]

    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=7), SamplingParams(top_k=5)]
    batch_seqs = make_seqs([others[0], others[1], target, others[2]])
    s2 = Sampler(seed=123)
    batched = []
    for step in range(30):
        rows = batch_seqs if step % 2 else batch_seqs[::-1]  # the row moves around the batch
        tokens, _ = s2(logits.expand(len(rows), 50).clone(), rows)
        batched.append(tokens[rows.index(batch_seqs[2])])
    assert batched == alone
    assert len(set(alone)) > 3  # really random draws
    other_seed = make_seqs([SamplingParams(temperature=1.0, seed=43)])
    assert [s1(logits[None].clone(), other_seed)[0][0] for _ in range(30)] != alone


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=1.0)] * 8
    assert sample(logits, params, seed=5) == sample(logits, params, seed=5)
    assert sample(logits, params, seed=5) != sample(logits, params, seed=6)


def test_tiny_temperature_behaves_like_greedy() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5)) * 3
    logits[:, 0] = -10.0  # the argmax is never token 0 (what argmax over a NaN row returns)
    tokens = sample(logits, [SamplingParams(temperature=1e-40)] * 6)
    assert tokens == logits.argmax(dim=-1).tolist()


# -- logprobs ----------------------------------------------------------------------------------------------------


def test_logprobs_are_from_the_raw_logits_top_n_sorted_and_per_row() -> None:
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(6)) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, logprobs=2),  # logprobs ignore temperature and filters
        SamplingParams(temperature=1.0),  # no logprobs asked
        SamplingParams(temperature=2.0, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.5, logprobs=20),
    ]
    tokens, lps = Sampler(0)(logits.clone(), make_seqs(params))
    ref = torch.log_softmax(logits, dim=-1)
    assert lps[2] is None
    for i, p in enumerate(params):
        lp = lps[i]
        if p.logprobs is None:
            continue
        assert isinstance(lp, TokenLogprobs)
        assert lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-5)
        assert len(lp.top) == p.logprobs
        values = list(lp.top.values())
        assert values == sorted(values, reverse=True)
        if p.logprobs:
            assert int(logits[i].argmax()) in lp.top
            for t, v in lp.top.items():
                assert v == pytest.approx(float(ref[i, t]), abs=1e-5)
            assert set(lp.top) == set(ref[i].topk(p.logprobs).indices.tolist())
    assert lps[0] is not None and lps[0].logprob == pytest.approx(float(ref[0].max()), abs=1e-5)


# -- through LLM on a tiny model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: ModelDir) -> pathlib.Path:
    return tiny_model_dir("llama")


def prompts() -> list[list[int]]:
    return [[5 + (i * 37 + j * 11) % 900 for j in range(3 + 4 * i)] for i in range(6)]


def seeded(seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 10, "ignore_eos": True, **kw})


def test_llm_seeded_request_reproduces_alone_and_in_a_mixed_batch(llama_dir: pathlib.Path) -> None:
    ps = prompts()
    alone = LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64, seed=0)
    want = alone.generate([ps[2]], seeded(1234))[0].token_ids
    assert len(want) == 10

    batch = LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64, seed=99)
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    outs = batch.generate(
        [ps[0], ps[2], ps[1], ps[2], ps[3]],
        [unseeded, seeded(1234), seeded(5, top_k=50), seeded(1234), unseeded],
    )
    assert outs[1].token_ids == want
    assert outs[3].token_ids == want  # the same seed twice in one batch: the same tokens twice
    other = batch.generate([ps[2]], seeded(1235))[0].token_ids
    assert other != want


def test_llm_seeded_requests_survive_preemption(llama_dir: pathlib.Path) -> None:
    ps = prompts()
    params = [seeded(100 + i) for i in range(len(ps))]
    roomy = LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=128, seed=0)
    want = [roomy.generate([p], sp)[0].token_ids for p, sp in zip(ps, params, strict=True)]
    tight = LLM.from_hf(
        llama_dir, dtype="float32", block_size=8, num_kv_blocks=8, max_num_batched_tokens=16, seed=1
    )
    got = [o.token_ids for o in tight.generate(ps, params)]
    assert tight.engine.stats().num_preemptions > 0
    assert got == want


def test_llm_greedy_logprobs_report_the_argmax(llama_dir: pathlib.Path) -> None:
    llm = LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64)
    out = llm.generate([prompts()[1]], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top) == 3 and next(iter(lp.top)) == token
        assert lp.logprob == pytest.approx(max(lp.top.values()))
        assert lp.logprob <= 0.0 and sum(math.exp(v) for v in lp.top.values()) <= 1.0 + 1e-6
    plain = llm.generate([prompts()[1]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert plain.logprobs is None and plain.token_ids == out.token_ids


def test_llm_sampled_logprobs_match_transformers(llama_dir: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    from tests.support.reference import hf_model

    prompt = prompts()[2]
    llm = LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64)
    out = llm.generate([prompt], seeded(7, logprobs=4, max_tokens=6))[0]
    assert out.logprobs is not None
    with torch.no_grad():
        logits = hf_model(llama_dir)(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-3)
        assert set(lp.top) == set(ref[i].topk(4).indices.tolist())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0), SamplingParams(top_k=1, seed=3)],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_k=1-seeded"],
)
def test_llm_filters_that_keep_one_token_equal_greedy(llama_dir: pathlib.Path, params: SamplingParams) -> None:
    llm = LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64, seed=0)
    params.temperature, params.max_tokens, params.ignore_eos = 1.5, 8, True
    want = llm.generate(prompts()[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    got = llm.generate(prompts()[:3], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    free = llm.generate(prompts()[:3], SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, seed=3))
    assert [o.token_ids for o in free] != [o.token_ids for o in want]  # unfiltered sampling does differ


def test_inverse_cdf_never_picks_zero_mass_and_takes_unnormalized_rows() -> None:
    from warmstart.runtime.engine.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0], [1e-9, 0.0, 0.0, 0.0, 0.0]])  # unnormalized, with zeros
    u = torch.tensor([[0.0], [0.249999], [0.25], [0.999999999]], dtype=torch.float64)
    rows = probs[[0, 0, 0, 0]]
    assert inverse_cdf(rows, u).tolist() == [1, 1, 3, 3]  # 2 / 8 of the mass is token 1's
    assert inverse_cdf(probs[[1, 1]], torch.tensor([[0.0], [0.9999999]], dtype=torch.float64)).tolist() == [0, 0]
    draws = inverse_cdf(probs[[0]].expand(20000, 5), torch.rand(20000, 1, generator=torch.Generator().manual_seed(0),
                                                                dtype=torch.float64))
    counts = torch.bincount(draws, minlength=5).tolist()
    assert counts[0] == counts[2] == counts[4] == 0 and abs(counts[1] / 20000 - 0.25) < 0.015


@pytest.mark.parametrize("chunk", [1, 3, 4, 1024])
def test_two_level_inverse_cdf_equals_one_cumulative_sum(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked, the inverse CDF picks what one float64 cumulative sum over the row picks, across chunk edges,
    in rows whose first, last or only chunks have no mass, and never a token of zero mass."""
    import warmstart.runtime.engine.sampler as sampler

    monkeypatch.setattr(sampler, "CDF_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 10, generator=gen)
    probs[probs < 0.5] = 0.0  # scattered zeros
    probs[0, :8] = 0.0  # mass only at the end
    probs[1, 2:] = 0.0  # mass only at the start
    probs[2, :] = 0.0
    probs[2, 5] = 1e-9  # a single token
    probs[:, 0] += (probs.sum(-1) == 0).float()  # no row without mass
    u = torch.rand(64, 1, generator=gen, dtype=torch.float64)
    u[:4] = torch.tensor([[0.0], [0.999999999999], [0.5], [1 - 2**-53]], dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    flat = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_max(9)
    got = sampler.inverse_cdf(probs, u)
    assert got.tolist() == flat.tolist()
    assert bool((probs.gather(1, got[:, None]) > 0).all())
