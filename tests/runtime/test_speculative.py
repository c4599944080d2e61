"""Speculative decoding: greedy output identical to plain decoding, sampling distributed as the target's,
and the KV pool's books exact after rejected proposals are rolled back."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from tests.support.model_configs import FAMILIES
from tests.support.prompts import make_prompts
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.engine.rejection_sampler import accept
from warmstart.runtime.engine.sampler import Sampler
from warmstart.runtime.engine.sequence import Sequence
from warmstart.runtime.engine.speculative import adapt_k, ngram_continuation
from warmstart.runtime.random_model import make_random_model, perturb_model

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """``draft_dir(family, noise)``: the family's tiny model with perturbed weights (noise 0: a copy)."""
    made: dict[tuple[str, float], pathlib.Path] = {}

    def get(family: str, noise: float) -> pathlib.Path:
        if (family, noise) not in made:
            out = tmp_path_factory.mktemp(f"draft-{family}")
            made[family, noise] = perturb_model(tiny_model_dir(family), out, noise, seed=1)
        return made[family, noise]

    return get


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy requests, every third with speculation off, and a few seeded sampled ones in the batch."""
    params = []
    for i in range(n):
        if i % 5 == 4:
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=i, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                         speculative=i % 3 != 0))
    return params


def greedy_only(outs: list[list[int]], params: list[SamplingParams]) -> list[list[int] | None]:
    return [o if p.greedy else None for o, p in zip(outs, params, strict=True)]


# -- greedy exactness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_plain_decoding(tiny_model_dir, draft_dir, family: str) -> None:
    model_dir = tiny_model_dir(family)
    prompts = make_prompts(FAMILIES[family]["vocab_size"])
    prompts.append(prompts[0][:20] * 3)  # something for prompt lookup to find
    params = mixed_params(len(prompts))
    plain = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=256)
    expected = greedy_only(generate(plain, prompts, params), params)

    draft = draft_dir(family, 0.02)
    for spec, k in (("draft", 3), ("ngram", 4)):
        llm = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=256, speculative=spec,
                          num_speculative_tokens=k, draft_model=draft if spec == "draft" else None)
        for _ in range(2):  # the second round is served from the prefix cache
            assert greedy_only(generate(llm, prompts, params), params) == expected, spec
        stats = llm.engine.stats()
        assert stats.prefix_cache_hits > 0
        assert stats.num_kv_blocks_used == 0
        if spec == "draft":  # a near copy of the target: some proposals accepted, some rejected
            assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens

    # Chunked prefill and preemption: 16 tokens a step, 14 blocks of 8 cannot hold the batch at once.
    llm = LLM.from_hf(model_dir, dtype="float32", block_size=8, num_kv_blocks=14, max_num_batched_tokens=16,
                      speculative="draft", num_speculative_tokens=3, draft_model=draft)
    assert greedy_only(generate(llm, prompts, params), params) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.num_kv_blocks_used == 0


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_bfloat16_greedy_matches_plain_decoding_and_a_copy_is_always_accepted(tmp_path, family: str) -> None:
    """In bfloat16 a k+1-token chunk rounds differently from k+1 one-token steps; verification attends each
    token as a decode query, and the draft decodes the same way, so outputs stay identical and a draft
    equal to the target is never rejected (mistral: its sliding window costs the draft some acceptance)."""
    model_dir = make_random_model(tmp_path / family, FAMILIES[family], seed=0, dtype="bfloat16")
    prompts = make_prompts(FAMILIES[family]["vocab_size"])[:8]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = generate(LLM.from_hf(model_dir, dtype="bfloat16", num_kv_blocks=128), prompts, [params] * 8)
    llm = LLM.from_hf(model_dir, dtype="bfloat16", num_kv_blocks=128, speculative="draft", draft_model=model_dir)
    assert generate(llm, prompts, [params] * 8) == plain
    stats = llm.engine.stats()
    if family != "mistral":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


# -- rollback and block accounting, with proposals whose acceptance the test controls --------------------


class OracleProposer:
    """Proposes the plain greedy continuation, corrupting the proposal at a position that cycles, so that
    every number of accepted tokens from 0 to k happens."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.vocab = vocab
        self.calls = 0
        self.expected_accepted = 0

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        for seq, k in zip(seqs, limits, strict=True):
            full = self.continuations[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            drafts = full[seq.num_output_tokens : seq.num_output_tokens + k]
            wrong = self.calls % (k + 2)
            self.calls += 1
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab
            self.expected_accepted += min(wrong, len(drafts))
            seq.spec_token_ids = drafts
            seq.spec_probs = None

    def verified(self, seq: Sequence) -> None:
        pass


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window lets blocks go
def test_rollback_keeps_block_accounting_exact(tiny_model_dir, family: str) -> None:
    model_dir = tiny_model_dir(family)
    prompts = make_prompts(FAMILIES[family]["vocab_size"])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=512)
    outs = generate(plain, prompts, [params] * len(prompts))

    options = EngineOptions(dtype="float32", block_size=4, num_kv_blocks=160, speculative="ngram",
                            num_speculative_tokens=4)
    engine = LLMEngine.from_hf(model_dir, options)
    oracle = OracleProposer({tuple(p): o for p, o in zip(prompts, outs, strict=True)}, engine.config.vocab_size)
    engine.speculation.proposer = oracle
    free_at_start = engine.blocks.num_free_blocks
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    bs = engine.blocks.block_size
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        holders = [0] * engine.blocks.num_blocks
        for seq in engine.scheduler.running:
            # Exactly the blocks of the computed tokens: rejected proposals' blocks went back.
            assert len(seq.block_table) == -(-seq.num_computed_tokens // bs)
            assert seq.num_computed_tokens <= seq.num_tokens - 1
            for b in seq.block_table:
                if b != Sequence.NO_BLOCK:
                    holders[b] += 1
        assert holders == engine.blocks.ref_counts
    assert [done[i] for i in ids] == outs
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens == oracle.expected_accepted > 0
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    assert engine.blocks.num_free_blocks == free_at_start
    assert all(r == 0 for r in engine.blocks.ref_counts)
    # Only verified tokens' full blocks were registered in the prefix cache.
    sequences = [tuple(p + o) for p, o in zip(prompts, outs, strict=True)]
    for block in engine.blocks.cached.values():
        tokens = engine.blocks.block_tokens[block]
        assert any(tokens in {s[i : i + bs] for i in range(0, len(s) - bs + 1, bs)} for s in sequences)


def test_stop_token_max_tokens_stop_string_and_logprobs_inside_an_accepted_run(tiny_model_dir, draft_dir) -> None:
    """A draft equal to the target is always accepted, so k + 1 tokens arrive per step; finishing in the
    middle of them must cut the output exactly where plain decoding stops."""
    model_dir = tiny_model_dir("llama")
    prompt = make_prompts(FAMILIES["llama"]["vocab_size"])[1]
    plain = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=64)
    spec = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=64, speculative="draft", num_speculative_tokens=4,
                       draft_model=draft_dir("llama", 0.0))
    full = plain.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    cases = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[full.token_ids[8]]),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[full.text[len(full.text) // 2 :][:3]]),
    ]
    for params in cases:
        a, b = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        if params.logprobs is not None:
            assert a.logprobs is not None and b.logprobs is not None
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and x.top.keys() == y.top.keys()
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    stats = spec.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert stats.num_kv_blocks_used == 0


# -- sampling -----------------------------------------------------------------------------------------


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper critical value of chi-square at p = 0.001 (z = 3.09), by the Wilson-Hilferty approximation."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def wrong_accept_always(sampler: Sampler, p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                        seq: Sequence) -> list[int]:
    return drafts + [int(sampler.draw(p[len(drafts)][None], [seq])[0])]


def wrong_resample_from_p(sampler: Sampler, p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                          seq: Sequence) -> list[int]:
    """Right acceptance test, but a rejection resamples from p instead of the residual."""
    k = len(drafts)
    qd = q[torch.arange(k), torch.tensor(drafts)] if q is not None else torch.ones(k)
    u = sampler.uniform(seq, k)
    for j in range(k):
        if u[j] * float(qd[j]) >= float(p[j, drafts[j]]):
            return drafts[:j] + [int(sampler.draw(p[j][None], [seq])[0])]
    return drafts + [int(sampler.draw(p[k][None], [seq])[0])]


def emitted_histograms(rule, q_kind: str, trials: int = 6000) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Run the rule on fixed target rows over a vocabulary of 6; histogram the first and second emitted
    tokens (the target's rows do not depend on earlier tokens, so they must follow p[0] and p[1])."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 6, 3
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
    sampler = Sampler(seed=0)
    seq = Sequence("r", [0], 1, SamplingParams(temperature=1.0, seed=1))
    seq.generator = torch.Generator().manual_seed(1)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    point_source = torch.tensor([3.0, 1, 0.5, 0.5, 0.2, 0.1])  # where prompt lookup's guesses come from
    for _ in range(trials):
        if q_kind == "draft":
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
            tokens = rule(sampler, p, drafts, q, seq)
        else:
            drafts = [int(torch.multinomial(point_source, 1, generator=gen)) for _ in range(k)]
            tokens = rule(sampler, p, drafts, None, seq)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second, p  # type: ignore[return-value]


@pytest.mark.parametrize("q_kind", ["draft", "point_mass"])
def test_accept_rule_reproduces_the_target_distribution(q_kind: str) -> None:
    first, second, p = emitted_histograms(accept, q_kind)
    critical = chi_square_critical(5)
    assert chi_square(first, p[0]) < critical
    assert chi_square(second, p[1]) < critical


@pytest.mark.parametrize("rule", [wrong_accept_always, wrong_resample_from_p])
@pytest.mark.parametrize("q_kind", ["draft", "point_mass"])
def test_the_distribution_test_catches_a_wrong_rule(rule, q_kind: str) -> None:  # type: ignore[no-untyped-def]
    first, second, p = emitted_histograms(rule, q_kind)
    assert chi_square(first, p[0]) > chi_square_critical(5)


def test_engine_sampling_matches_the_target_distribution(tiny_model_dir, draft_dir) -> None:
    """Through the whole engine (draft model, its q, per-request seeds): the first two generated tokens of
    a top-5 request follow the target's exact joint distribution, computed from its logprobs."""
    model_dir = tiny_model_dir("llama")
    prompt = make_prompts(FAMILIES["llama"]["vocab_size"])[2]
    plain = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=64)

    def top5(tokens: list[int]) -> dict[int, float]:
        lp = plain.generate([tokens], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0].logprobs
        assert lp is not None
        weights = {t: math.exp(v) for t, v in lp[0].top.items()}
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}

    joint = {(a, b): pa * pb for a, pa in top5(prompt).items() for b, pb in top5(prompt + [a]).items()}
    cells = sorted(joint)
    spec = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=256, max_num_seqs=64, speculative="draft",
                       num_speculative_tokens=3, draft_model=draft_dir("llama", 0.05))
    n = 1500
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=5, seed=i, ignore_eos=True) for i in range(n)]
    outs = generate(spec, [prompt] * n, params)
    counts = torch.zeros(len(cells))
    outside = 0  # pairs the target gives probability 0 (outside its top 5)
    for out in outs:
        if (out[0], out[1]) in joint:
            counts[cells.index((out[0], out[1]))] += 1
        else:
            outside += 1
    probs = torch.tensor([joint[c] for c in cells])
    assert outside == 0
    assert chi_square(counts, probs) < chi_square_critical(len(cells) - 1)
    stats = spec.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_seeded_request_is_reproducible_whatever_shares_its_batch(tiny_model_dir, draft_dir) -> None:
    model_dir = tiny_model_dir("qwen2")
    prompts = make_prompts(FAMILIES["qwen2"]["vocab_size"])
    llm = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=256, speculative="draft",
                      num_speculative_tokens=3, draft_model=draft_dir("qwen2", 0.02))
    seeded = SamplingParams(max_tokens=16, temperature=0.9, seed=1234, ignore_eos=True)
    alone = generate(llm, [prompts[0]], [seeded])[0]
    others = [SamplingParams(max_tokens=16, temperature=0.9, ignore_eos=True)] * (len(prompts) - 1)
    together = generate(llm, prompts, [seeded, *others])[0]
    assert alone == together


# -- options ------------------------------------------------------------------------------------------


def test_request_can_turn_speculation_off(tiny_model_dir, draft_dir) -> None:
    llm = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=64, speculative="draft",
                      draft_model=draft_dir("llama", 0.0))
    prompts = make_prompts(FAMILIES["llama"]["vocab_size"])[:4]
    params = SamplingParams(max_tokens=8, temperature=0.0, speculative=False)
    generate(llm, prompts, [params] * len(prompts))
    assert llm.engine.stats().spec_num_drafts == 0
    generate(llm, prompts, [GREEDY] * len(prompts))
    assert llm.engine.stats().spec_num_drafts > 0


def test_bad_options_are_refused_clearly(tiny_model_dir, tmp_path) -> None:
    model_dir = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineOptions(speculative="medusa").validate()
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineOptions(speculative="ngram", num_speculative_tokens=0).validate()
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=16, speculative="draft")
    other_vocab = make_random_model(tmp_path / "other", {**FAMILIES["llama"], "vocab_size": 512}, dtype="float32")
    with pytest.raises(ValueError, match="vocabulary"):
        LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=16, speculative="draft", draft_model=other_vocab)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")  # type: ignore[arg-type]


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    assert ngram_continuation(tokens, 3, max_n=4, min_n=2) == [2, 3, 6]  # latest "6 7" is at index 6
    assert ngram_continuation([1, 2, 3, 4, 1, 2, 3], 2, max_n=3, min_n=2) == [4, 1]
    assert ngram_continuation([1, 2, 3, 4], 2, max_n=3, min_n=1) == []
    assert ngram_continuation([1, 2, 9, 1, 2], 5, max_n=3, min_n=2) == [9, 1, 2]


def test_random_draft_never_changes_greedy_output(tmp_path, tiny_model_dir) -> None:
    """A draft of another seed is almost never right: nearly every proposal is rolled back."""
    model_dir = tiny_model_dir("qwen3")
    other = make_random_model(tmp_path / "other", FAMILIES["qwen3"], seed=7, dtype="float32")
    prompts = make_prompts(FAMILIES["qwen3"]["vocab_size"])
    plain = generate(LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=128), prompts, [GREEDY] * len(prompts))
    llm = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=128, speculative="draft", draft_model=other)
    assert generate(llm, prompts, [GREEDY] * len(prompts)) == plain
    assert llm.engine.stats().spec_num_draft_tokens > 0


def test_adaptive_k_follows_acceptance_and_keeps_output(tmp_path, tiny_model_dir, draft_dir) -> None:
    seq = Sequence("r", [1], 1, GREEDY)
    adapt_k(seq, proposed=4, accepted=1, k_max=4)
    assert seq.spec_k == 2
    adapt_k(seq, proposed=2, accepted=2, k_max=4)
    assert seq.spec_k == 3
    adapt_k(seq, proposed=3, accepted=0, k_max=4)
    assert seq.spec_k == 1

    model_dir = tiny_model_dir("qwen2")
    prompts = make_prompts(FAMILIES["qwen2"]["vocab_size"])
    plain = generate(LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=128), prompts, [GREEDY] * len(prompts))
    options = EngineOptions(dtype="float32", num_kv_blocks=128, speculative="draft", num_speculative_tokens=4,
                            adaptive_speculation=True)
    other = make_random_model(tmp_path / "other", FAMILIES["qwen2"], seed=7, dtype="float32")
    for draft in (draft_dir("qwen2", 0.02), other):
        llm = LLM(LLMEngine.from_hf(model_dir, options, draft))
        assert generate(llm, prompts, [GREEDY] * len(prompts)) == plain
    # A draft that is never right is soon asked for one token a step instead of four.
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens < 1.5 * stats.spec_num_drafts
