"""Speculative decoding against plain decoding, side by side, at a controlled acceptance rate.

    python -m benchmarks.speculative [--config ../shared/bench/models/smollm2-135m.json] [--k 4]
                                     [--noise 0 0.0005 0.002] [--new-tokens 32] [--rounds 3] [--dtype bfloat16]

Random weights give a random acceptance rate, so the draft is the target itself with its weights perturbed
by increasing noise (w + noise * std(w) * N(0, 1)): noise 0 is an exact copy, always accepted, which
measures the pure overhead of proposing and verifying. Prompt lookup (ngram) runs on a workload whose
prompts repeat one random passage four times. Every row is measured in this one process against plain
decoding of the same requests, at batch 1 and batch 16 (greedy, 32-token prompts, --new-tokens each).

Printed per row: the measured acceptance rate (accepted / proposed), tokens/s with and without
speculation, and their ratio. Then the cost model behind the break-even acceptance rate: with per-token
acceptance a, one pass emits E(a) = (1 - a^(k+1)) / (1 - a) tokens and costs k draft steps plus one
verification of k + 1 tokens; the break-even a solves E(a) = (k * t_draft + t_verify) / t_plain with
the step times measured here.
"""

from __future__ import annotations

import random
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.throughput import model_dir
from benchmarks.workloads import SHARED_BENCH
from warmstart.runtime import SamplingParams
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.weights import LayerWeights, ModelWeights, load_weights

PROMPT_TOKENS = 32


def perturbed(weights: ModelWeights, noise: float, seed: int = 1) -> ModelWeights:
    """A copy of the weights (never shared: prepacking rewrites them in place) with matrices perturbed."""
    gen = torch.Generator().manual_seed(seed)

    def p(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if t.dim() < 2 or noise == 0:
            return t.clone()
        w = t.float()
        return (w + noise * w.std() * torch.randn(w.shape, generator=gen)).to(t.dtype)

    layers = [LayerWeights(**{f.name: p(getattr(layer, f.name)) for f in fields(LayerWeights)})  # type: ignore[arg-type]
              for layer in weights.layers]
    embed = p(weights.embed)
    assert embed is not None
    tied = weights.lm_head is weights.embed
    lm_head = embed if tied else p(weights.lm_head)  # type: ignore[arg-type]
    return ModelWeights(embed=embed, layers=layers, norm=p(weights.norm), lm_head=lm_head)  # type: ignore[arg-type]


def prompts(batch: int, vocab: int, repeat: bool, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if repeat:  # a passage, four times: prompt lookup finds its continuation if the model copies it
        out = []
        for _ in range(batch):
            passage = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS // 4)]
            out.append(passage * 4)
        return out
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


def run(engine: LLMEngine, batch: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """Seconds to generate ``new_tokens`` for every prompt of the batch at once; tokens generated."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in batch:
        engine.add_request(p, params)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in running):
        engine.step()  # prefill outside the timed part: decode is what speculation changes
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - t0, tokens


def make_engine(config: ModelConfig, weights: ModelWeights, draft: ModelWeights | None, spec: str | None,
                k: int, adaptive: bool = False) -> LLMEngine:
    dtype = str(weights.embed.dtype).removeprefix("torch.")
    options = EngineOptions(dtype=dtype, num_kv_blocks=512, max_num_seqs=16, speculative=spec,
                            num_speculative_tokens=k, max_model_len=512, adaptive_speculation=adaptive)
    engine = LLMEngine.from_weights(config, perturbed(weights, 0.0), None, options,
                                    (config, draft) if draft is not None else None)
    if engine.prepack_thread is not None:
        engine.prepack_thread.join()
    run(engine, prompts(1, config.vocab_size, False, seed=99), 4)  # warm-up
    return engine


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3)
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.0005, 0.002])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--adaptive", action="store_true", help="also rows with k adapted per sequence")
    args = harness.parse(ap)

    path = model_dir(args.config)
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, getattr(torch, args.dtype))
    print(f"model {args.config.stem} (random weights, {args.dtype}), k={args.k}, {PROMPT_TOKENS}-token prompts, "
          f"{args.new_tokens} new tokens each, greedy, torch threads {torch.get_num_threads()}; plain and "
          f"speculative runs alternate, median of {args.rounds}")
    plain = make_engine(config, weights, None, None, args.k)
    print(f"{'proposer':<26}{'batch':>6}{'accept':>8}{'tok/s':>9}{'plain':>9}{'ratio':>8}")
    rows = [(f"draft noise {n:g}", "draft", n, False) for n in args.noise]
    if args.adaptive:
        rows += [(f"draft noise {n:g} adapt", "draft", n, True) for n in args.noise if n > 0]
    rows.append(("ngram (repeated prompt)", "ngram", None, False))
    costs: dict[int, tuple[float, float, float]] = {}
    table: list[dict[str, Any]] = []
    for label, spec, noise, adaptive in rows:
        draft = perturbed(weights, noise) if noise is not None else None
        engine = make_engine(config, weights, draft, spec, args.k, adaptive)
        timer = ProposeTimer(engine)
        for b in args.batches:
            batch = prompts(b, config.vocab_size, spec == "ngram")
            plain_s, spec_s, propose_s, passes = [], [], [], []
            before = engine.stats()
            for _ in range(args.rounds):
                seconds, tokens = run(plain, batch, args.new_tokens)
                plain_s.append(seconds)
                drafts, timed = engine.stats().spec_num_drafts, timer.seconds
                seconds, tokens = run(engine, batch, args.new_tokens)
                spec_s.append(seconds)
                propose_s.append(timer.seconds - timed)
                passes.append((engine.stats().spec_num_drafts - drafts) / b)
            after = engine.stats()
            drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
            accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            rate = accepted / drafted if drafted else float("nan")
            spec_tps, plain_tps = tokens / harness.median(spec_s), tokens / harness.median(plain_s)
            ratio = harness.ratio(plain_s, spec_s)
            table.append({"proposer": label, "batch": b, "acceptance": rate, "tok_s": spec_tps,
                          "plain_tok_s": plain_tps, "speedup": ratio})
            print(f"{label:<26}{b:>6}{rate:>8.2f}{spec_tps:>9.1f}{plain_tps:>9.1f}{ratio['median']:>7.2f}x",
                  flush=True)
            if noise == 0.0 and not adaptive:  # all accepted: each step is one pass of k draft steps + a verification
                i = spec_s.index(harness.median(spec_s)) if args.rounds % 2 else 0
                step_s = harness.median(plain_s) / (args.new_tokens - 1)
                costs[b] = ((spec_s[i] - propose_s[i]) / passes[i], propose_s[i] / passes[i] / args.k, step_s)
        del engine

    if costs:
        print(f"\nbreak-even, from the noise-0 rows (each step a full pass of k={args.k}), in plain decode steps:")
        for b, (verify_s, draft_step_s, step_s) in costs.items():
            verify, draft_step = verify_s / step_s, draft_step_s / step_s
            print(f"  batch {b}: verifying k+1 tokens costs {verify:.2f} steps, a draft step {draft_step:.2f}")
            print(f"    this draft (same size as the target): {break_even(args.k, verify + args.k * draft_step)}")
            print(f"    free proposals (prompt lookup):        {break_even(args.k, verify)}")
    harness.report(args, {"model": args.config.stem, "dtype": args.dtype, "k": args.k, "rows": table,
                          "break_even_costs": costs})


class ProposeTimer:
    """Accumulates the time the engine spends in its proposer."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        proposer = engine.speculation.proposer
        assert proposer is not None
        inner = proposer.propose

        def timed(seqs, limits):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            inner(seqs, limits)
            self.seconds += time.perf_counter() - t0

        proposer.propose = timed  # type: ignore[method-assign]


def break_even(k: int, cost: float) -> str:
    """Per-token acceptance a at which E(a) = (1 - a^(k+1)) / (1 - a) equals the pass's cost in steps."""
    if cost >= k + 1:
        return f"pass costs {cost:.2f} steps: no break-even (acceptance 1 emits only {k + 1} tokens a pass)"
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**i for i in range(k + 1)) < cost:
            lo = a
        else:
            hi = a
    return f"pass costs {cost:.2f} steps: break-even per-token acceptance {lo:.2f}"


if __name__ == "__main__":
    main()
