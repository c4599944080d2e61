"""How far bfloat16 logits drift from float32, ours and transformers' side by side: whether a greedy difference
between two bfloat16 runs is rounding or a defect.

    python -m benchmarks.bf16_drift [--model smollm2-135m] [--device cuda] [--lens 7,60,200,400]

For each prompt (random token ids, seed 0) it computes the last position's logits four ways on one device:
transformers in float32 (the reference: the model's weights are bfloat16 values, so float32 holds them
exactly), transformers in bfloat16, and the engine in bfloat16 and float32 (one prefill chunk through
LLMEngine's runner: on CUDA the Triton kernels, on the CPU the PyTorch path). It prints each one's largest
distance from the reference and whether its argmax agrees. If ours in bfloat16 lands as close to float32 as
transformers in bfloat16 does, a greedy difference between the two bf16 runs is rounding. benchmarks/gpu_check.py
runs it as its bf16_drift section, with ``verdict``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.gpu_check import bench_model_dir, engine_on
from warmstart.runtime.engine.model_runner import Chunk

ROOT = Path(__file__).resolve().parent.parent

BLOCK_SIZE = 16


def ours_logits(model_dir: Path, dtype: str, device: torch.device, prompts: list[list[int]]) -> list[torch.Tensor]:
    blocks = max(-(-len(p) // BLOCK_SIZE) for p in prompts)
    engine, _ = engine_on(model_dir, dtype, device, (1,), block_size=BLOCK_SIZE, num_kv_blocks=blocks + 1)
    out = [engine.runner.forward([Chunk(list(range(blocks)), p, 0, 1)])[0].float().cpu() for p in prompts]
    del engine
    return out


def transformers_logits(
    model_dir: Path, dtype: str, device: torch.device, prompts: list[list[int]]
) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.no_grad():
        out = [model(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts]
    del model
    return out


def drift(model_dir: Path, device: torch.device, lens: list[int]) -> list[dict[str, Any]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(16, vocab - 16) for _ in range(n)] for n in lens]
    reference = transformers_logits(model_dir, "float32", device, prompts)
    runs = {
        "transformers_bf16": transformers_logits(model_dir, "bfloat16", device, prompts),
        "ours_bf16": ours_logits(model_dir, "bfloat16", device, prompts),
        "ours_fp32": ours_logits(model_dir, "float32", device, prompts),
    }
    rows = []
    for i, (n, ref) in enumerate(zip(lens, reference, strict=True)):
        top = ref.topk(2).values
        row: dict[str, Any] = {"prompt_tokens": n, "ref_scale": float(ref.abs().max()),
                               "ref_top2_gap": float(top[0] - top[1])}  # fmt: skip
        for name, logits in runs.items():
            row[f"{name}_max_diff"] = float((logits[i] - ref).abs().max())
            row[f"{name}_argmax_agrees"] = int(logits[i].argmax()) == int(ref.argmax())
        rows.append(row)
    return rows


# Ours in bfloat16 may drift this much more than transformers in bfloat16 (the mean over the prompts of each one's
# largest distance from float32), and ours in float32 this far from transformers in float32, before it is a defect.
DRIFT_RATIO_LIMIT = 1.5
FLOAT32_LIMIT = 1e-2


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ours = sum(r["ours_bf16_max_diff"] for r in rows) / len(rows)
    theirs = sum(r["transformers_bf16_max_diff"] for r in rows) / len(rows)
    ratio = ours / max(theirs, 1e-6)
    float32 = max(r["ours_fp32_max_diff"] for r in rows)
    return {"drift_ratio": ratio, "ours_fp32_max_diff": float32,
            "matches": ratio <= DRIFT_RATIO_LIMIT and float32 <= FLOAT32_LIMIT, "rows": rows}  # fmt: skip


def main() -> None:
    parser = harness.arguments(__doc__, rounds=None)
    parser.add_argument("--model", default="smollm2-135m", help="a config in benchmarks/models/")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lens", default="7,60,200,400", help="prompt lengths, comma-separated")
    args = harness.parse(parser)
    device = torch.device(args.device)
    rows = drift(bench_model_dir(args.model), device, [int(n) for n in args.lens.split(",")])
    print(f"bf16 drift from transformers float32, {args.model} (random weights), {device}")
    print(f"{'tokens':>6} {'|ref|':>7} {'gap':>6}  {'hf bf16':>14} {'ours bf16':>14} {'ours fp32':>14}")
    for r in rows:
        cells = [f"{r[f'{k}_max_diff']:8.4f} {'ok' if r[f'{k}_argmax_agrees'] else 'DIFF':>4}"
                 for k in ("transformers_bf16", "ours_bf16", "ours_fp32")]  # fmt: skip
        print(f"{r['prompt_tokens']:>6} {r['ref_scale']:7.3f} {r['ref_top2_gap']:6.3f}  " + "  ".join(cells))
    v = verdict(rows)
    print(f"ours bf16 drifts {v['drift_ratio']:.2f}x as far as transformers bf16; ours fp32 within "
          f"{v['ours_fp32_max_diff']:.1e}: {'ok' if v['matches'] else 'DEFECT'}")
    harness.report(args, {"model": args.model, "device": str(device), "rows": rows, "verdict": v})


if __name__ == "__main__":
    main()
