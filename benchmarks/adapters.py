"""Adapters compiled into prefix KV: a batch mixing 8 adapters against one adapter and against peft, and the
time to first token behind an adapter against the base model with no prefix.

    python -m benchmarks.adapters [--requests 32] [--prompt-tokens 64] [--max-tokens 32] [--rounds 3] [--json OUT]

The model is the SmolLM2-135M shape (random weights, bf16). Eight PEFT adapters (prompt tuning, P-tuning and
prefix tuning with and without the projection; 12 to 40 virtual tokens) are saved by peft and compiled into
one snapshot. Then, round after round, alternating: (a) warmstart runs the requests with adapter i % 8, all in
one continuous batch; (b) the same requests all with one adapter; (c) with none; and (d) once, peft serves
the same requests as it can, one adapter at a time (a PeftModel per adapter, `generate` over that adapter's
requests as one batch). Prefix caching is off, so every round computes its prompts in full. Goals: (a) at
least 90% of (b); time to first token with an adapter within 10% of the base model's with no prefix (a fresh
prompt each time).

peft caveat: with transformers 5, `PeftModel.generate` applies a prompt-tuning adapter to the prompt but not
to later tokens, and ignores prefix tuning altogether (see tests/support/peft_reference.py), so its (d) does less
work than serving the adapters correctly would: the ratio against it is a lower bound.
"""

from __future__ import annotations

import functools
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.throughput import model_dir as bench_model_dir
from benchmarks.workloads import SHARED_BENCH

# name -> (peft config class, options)
ADAPTERS: dict[str, tuple[str, dict[str, Any]]] = {
    "prompt-20": ("PromptTuningConfig", {"num_virtual_tokens": 20}),
    "prompt-32": ("PromptTuningConfig", {"num_virtual_tokens": 32}),
    "ptune-mlp-16": ("PromptEncoderConfig", {"num_virtual_tokens": 16, "encoder_hidden_size": 128}),
    "ptune-lstm-12": ("PromptEncoderConfig", {"num_virtual_tokens": 12, "encoder_hidden_size": 64,
                                              "encoder_reparameterization_type": "LSTM"}),
    "prefix-24": ("PrefixTuningConfig", {"num_virtual_tokens": 24}),
    "prefix-40": ("PrefixTuningConfig", {"num_virtual_tokens": 40}),
    "prefix-proj-30": ("PrefixTuningConfig", {"num_virtual_tokens": 30, "prefix_projection": True,
                                              "encoder_hidden_size": 128}),
    "prefix-proj-16": ("PrefixTuningConfig", {"num_virtual_tokens": 16, "prefix_projection": True,
                                              "encoder_hidden_size": 128}),
}


def save_adapters(model: Path, out: Path) -> dict[str, Path]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    paths = {}
    for i, (name, (kind, options)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        peft_model = peft.get_peft_model(base, getattr(peft, kind)(task_type="CAUSAL_LM", **options))
        peft_model.save_pretrained(out / name)
        paths[name] = out / name
    return paths


def run_ours(llm: Any, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> float:
    from warmstart.runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, adapter=adapters)
    seconds = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs) / seconds


def run_peft(model: Path, paths: dict[str, Path], prompts: list[list[int]], max_tokens: int) -> float:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    names = list(paths)
    peft_models = {}
    for name in names:
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
        peft_models[name] = peft.PeftModel.from_pretrained(base, paths[name]).eval()
    generated = 0
    t = time.perf_counter()
    with torch.no_grad():
        for i, name in enumerate(names):
            group = torch.tensor(prompts[i :: len(names)])  # the requests that name this adapter, as one batch
            out = peft_models[name].generate(input_ids=group, attention_mask=torch.ones_like(group),
                                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                             eos_token_id=None, pad_token_id=0)
            generated += (out.shape[1] - group.shape[1]) * group.shape[0]
    return generated / (time.perf_counter() - t)


def ttft(llm: Any, prompt: list[int], adapter: str | None) -> float:
    from warmstart.runtime import SamplingParams

    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), adapter=adapter)[0]
    seconds = time.perf_counter() - t
    assert out.cached_tokens == 0, "a fresh prompt: nothing of it may come from the prefix cache"
    return seconds


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3, warmup=0)
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ttft-reps", type=int, default=9)
    ap.add_argument("--no-peft", action="store_true", help="skip the peft baseline")
    args = harness.parse(ap)

    import torch

    from warmstart.runtime.models.config import ModelConfig
    from warmstart.snapshot.adapters import AdapterSpec
    from warmstart.snapshot.build import BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.loader import load

    model = bench_model_dir(args.config)
    vocab = ModelConfig.from_dir(model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(16, vocab - 16) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    names = list(ADAPTERS)
    mixed: list[str | None] = [names[i % len(names)] for i in range(args.requests)]
    one: list[str | None] = [names[0]] * args.requests
    none: list[str | None] = [None] * args.requests
    with tempfile.TemporaryDirectory() as tmp:
        paths = save_adapters(model, Path(tmp) / "adapters")
        cache = BlobCache(Path(tmp) / "cache")
        specs = [AdapterSpec(name, path) for name, path in paths.items()]
        built = build_snapshot(model, BuildOptions(dtype="bfloat16", adapters=specs), cache)
        # Prefix caching off, so that every round computes its prompts (adapters' pinned blocks are still found).
        llm = load(built.id, cache=cache, num_kv_blocks=1024, max_num_seqs=max(64, args.requests),
                   enable_prefix_caching=False)
        if llm.engine.prepack_thread is not None:
            llm.engine.prepack_thread.join()
        run_ours(llm, prompts[:4], mixed[:4], 2)  # warm-up
        arms = {"mixed": mixed, "one": one, "none": none}
        rates = harness.alternate({key: functools.partial(run_ours, llm, prompts, adapters, args.max_tokens)
                                   for key, adapters in arms.items()}, args.rounds, args.warmup)  # fmt: skip
        base_ttft, adapter_ttft = [], []
        for i in range(args.ttft_reps):  # a fresh prompt each time, so neither side hits the prefix cache
            probe = [rng.randrange(16, vocab - 16) for _ in range(args.prompt_tokens)]
            base_ttft.append(ttft(llm, probe, None))
            adapter_ttft.append(ttft(llm, probe, names[i % len(names)]))
        del llm
        peft_rate = None if args.no_peft else run_peft(model, paths, prompts, args.max_tokens)
    med = harness.medians(rates)
    result = {
        "model": args.config.stem, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
        "tok_s_mixed_8": med["mixed"], "tok_s_one_adapter": med["one"], "tok_s_no_adapter": med["none"],
        "mixed_over_one": harness.ratio(rates["mixed"], rates["one"]), "tok_s_peft": peft_rate,
        "mixed_over_peft": med["mixed"] / peft_rate if peft_rate else None,
        "ttft_base_s": harness.median(base_ttft), "ttft_adapter_s": harness.median(adapter_ttft),
        "ttft_adapter_over_base": harness.median(adapter_ttft) / harness.median(base_ttft),
    }
    print(f"{args.requests} requests of {args.prompt_tokens} prompt tokens, {args.max_tokens} generated each, "
          f"{args.config.stem} (random bf16), medians of {args.rounds} rounds")
    print(f"  warmstart, 8 adapters mixed in one batch: {med['mixed']:8.1f} tok/s")
    print(f"  warmstart, one adapter for all:           {med['one']:8.1f} tok/s   "
          f"mixed/one = {harness.ratio_text(result['mixed_over_one'])} (goal >= 0.90)")
    print(f"  warmstart, no adapter:                    {med['none']:8.1f} tok/s")
    if peft_rate:
        print(f"  peft, one adapter at a time:              {peft_rate:8.1f} tok/s   "
              f"warmstart mixed / peft = {med['mixed'] / peft_rate:.2f}x (a lower bound, see the docstring)")
    print(f"  time to first token ({args.prompt_tokens}-token prompt): "
          f"no adapter {result['ttft_base_s'] * 1e3:.1f} ms, "
          f"behind an adapter {result['ttft_adapter_s'] * 1e3:.1f} ms, "
          f"ratio {result['ttft_adapter_over_base']:.3f} (goal <= 1.10)")
    harness.report(args, result)


if __name__ == "__main__":
    main()
