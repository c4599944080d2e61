"""Each quantization scheme against the bf16 model, side by side: bytes, logit error, greedy agreement, speed.

    python -m benchmarks.quant_quality [--rounds 5] [--prompts 16] [--max-tokens 32] [--json OUT]

The model is the SmolLM2-135M-shaped random model of benchmarks/throughput.py (bf16, tied embeddings). For
each scheme (and int8 with its head quantized too, the option quantize_model leaves off), and for the same
weights in float32 (no quantization: the noise floor; 30 random layers amplify any perturbation, so even
bf16 against fp32 flips many top tokens and most greedy continuations):

- weight MiB: bytes of every weight tensor as held in memory (a tied head is the embedding, counted once);
- logit error: max and mean abs difference of the logits at every position of a fixed prompt set (random
  token ids, seed 0), teacher-forced, and how often the top token agrees;
- greedy: fraction of prompts whose --max-tokens greedy tokens all match, and the mean matching prefix;
- decode tok/s at batch 1 and 16 (the engine's step loop once every prompt is prefilled) and prefill tok/s of
  one 256-token prompt; engines take turns round after round, medians are printed.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.quant_eval import compare_to_float, prompt_logits
from benchmarks.throughput import model_dir
from benchmarks.workloads import SHARED_BENCH
from warmstart.runtime import EngineOptions, LLMEngine, SamplingParams
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.model import Model
from warmstart.runtime.models.quantize import quantize_model
from warmstart.runtime.models.weights import ModelWeights, load_weights

VARIANTS = {"bf16": ("none", False), "fp32": ("none", False), "int8": ("int8", False),
            "int8+head": ("int8", True), "int4": ("int4", False), "nf4": ("nf4", False)}


def decode_tok_s(model: Model, batch: int, steps: int = 16, prompt_len: int = 32) -> float:
    engine = LLMEngine(model, None, EngineOptions(num_kv_blocks=batch * 8 + 8, max_num_seqs=batch))
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(3, 2000, (prompt_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # prefill every prompt first
        started.update(o.request_id for o in engine.step())
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return batch * steps / (time.perf_counter() - t)


def prefill_tok_s(model: Model, tokens: int = 256) -> float:
    engine = LLMEngine(model, None, EngineOptions(num_kv_blocks=tokens // 16 + 2, max_num_seqs=1))
    prompt = torch.randint(3, 2000, (tokens,), generator=torch.Generator().manual_seed(7)).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    engine.step()
    return tokens / (time.perf_counter() - t)


def weight_bytes(weights: ModelWeights) -> int:
    return sum(t.nbytes for t in weights.tensors().values())


def main() -> None:
    ap = harness.arguments(__doc__, rounds=5)
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = harness.parse(ap)

    path = model_dir(args.config)
    config = ModelConfig.from_dir(path)
    base = load_weights(path, config, torch.bfloat16)
    fp32 = load_weights(path, config, torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 65, (args.prompts,), generator=g)]
    models, rows = {}, {}
    print(f"{args.config.stem} (random weights), bf16 reference, {len(prompts)} prompts of 8-64 tokens, "
          f"{args.max_tokens} greedy tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in ["bf16"] + [v for v in args.variants if v != "bf16"]:  # the reference first
        scheme, head = VARIANTS[name]
        t = time.perf_counter()
        weights = quantize_model(fp32 if name == "fp32" else base, scheme, quantize_head=head)
        quantize_s = time.perf_counter() - t
        models[name] = Model(config, weights, 4096)
        groups = {m.get("group_size") for m in weights.quant_meta().values()} - {None}
        rows[name] = {"weight_mib": weight_bytes(weights) / 2**20, "group_size": min(groups) if groups else None,
                      "quantize_s": quantize_s}
        if name != "bf16":
            rows[name].update(compare_to_float(models["bf16"], models[name], prompts, args.max_tokens))
    models.pop("fp32", None)  # quality only
    logit_std = float(torch.cat([prompt_logits(models["bf16"], p) for p in prompts]).std())
    speeds: dict[str, dict[str, list[float]]] = {n: {"b1": [], "b16": [], "prefill": []} for n in models}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, model in models.items():
                speeds[name]["b1"].append(decode_tok_s(model, 1))
                speeds[name]["b16"].append(decode_tok_s(model, 16))
                speeds[name]["prefill"].append(prefill_tok_s(model))
    for name in models:
        rows[name].update({f"{k}_tok_s": harness.median(v) for k, v in speeds[name].items()})
    rows.get("fp32", {}).update({f"{k}_tok_s": float("nan") for k in ("b1", "b16", "prefill")})

    ref = rows["bf16"]
    print(f"\n{'scheme':<10}{'group':>6}{'weight MiB':>11}{'max |dlogit|':>13}{'mean':>7}{'top1':>7}"
          f"{'greedy':>8}{'prefix':>8}{'dec b1':>8}{'dec b16':>9}{'prefill':>9}")
    for name, r in rows.items():
        quality = (f"{r['max_abs_logit_diff']:>13.3f}{r['mean_abs_logit_diff']:>7.3f}{r['top1_agreement']:>7.1%}"
                   f"{r['greedy_agreement']:>8.0%}{r['mean_matching_prefix']:>8.1f}") if name != "bf16" else \
            f"{'(reference)':>13}{'':>7}{'':>7}{'':>8}{'':>8}"
        print(f"{name:<10}{r['group_size'] or '-':>6}{r['weight_mib']:>11.1f}{quality}"
              f"{r['b1_tok_s']:>8.1f}{r['b16_tok_s']:>9.1f}{r['prefill_tok_s']:>9.0f}")
    print("\nspeed relative to bf16 (> 1: faster)")
    for name, r in rows.items():
        if name == "fp32":
            continue
        print(f"{name:<10}" + "".join(f"{k}: {r[f'{k}_tok_s'] / ref[f'{k}_tok_s']:.2f}x  "
                                      for k in ("b1", "b16", "prefill")))
    print("\ntok/s: decode at batch 1 and 16 (generated tokens per second), prefill of one 256-token prompt; "
          f"the bf16 model's logits have std {logit_std:.2f}")
    harness.report(args, {"logit_std": logit_std, "schemes": rows})


if __name__ == "__main__":
    main()
