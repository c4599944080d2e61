"""Many LoRA adapters at once: 8 adapters mixed in one stream vs the base model alone vs one adapter
merged into the weights, side by side in one run; optionally vLLM's CPU build on the same load.

    python -m benchmarks.lora [--requests 32] [--prompt-tokens 64] [--max-tokens 32] [--rank 16] [--rounds 3]
                              [--vllm] [--json OUT]

The model is the SmolLM2-135M shape (random weights, bf16). Eight random rank-``--rank`` LoRA adapters over
q/k/v/o/gate/up/down are written in PEFT's format (adapter_config.json by peft's LoraConfig). Round after round,
the arms' order rotating, warmstart runs the same ``--requests`` requests (fresh random prompts, greedy, EOS
ignored, prefix caching off) as (mixed) one burst whose request i names adapter i % 8, served unmerged from 8
slots, the LoRA adds on the bf16 CPU kernel (runtime/kernels/cpu_lora.c) where it serves; (mixed-torch) the same
burst on the same engine with the LoRA adds on the PyTorch path (runtime/layers/lora.py, the reference); (base)
the same burst on the same engine with no adapter; (merged) the same burst on an engine whose weights have adapter
0 merged in. Reported: generated tokens/s and the median time to first token of the burst's requests (arrival to
first token), per round and as medians, and the ratios per round (goal: mixed >= 0.8x base at rank 16). Then,
alternating, the time to first token of one fresh prompt alone behind an adapter and without one.

--vllm also runs benchmarks/peers/run_vllm_lora.py with vLLM's venv (/work/peers/vllm/.venv): vLLM's CPU build
with --enable-lora (max_loras 8) on the same requests and adapters, its own mixed and base rounds alternating
in its process; its tok/s and its own mixed/base ratio are printed beside ours.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.throughput import model_dir as bench_model_dir
from benchmarks.workloads import SHARED_BENCH

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_ADAPTERS = 8
VLLM_PYTHON = Path("/work/peers/vllm/.venv/bin/python")


def save_adapters(model: Path, out: Path, rank: int) -> dict[str, Path]:
    """Eight random adapters in PEFT's format (B nonzero, so that they change the output)."""
    import peft
    import torch
    from safetensors.torch import save_file

    from warmstart.runtime.models.config import ModelConfig

    c = ModelConfig.from_dir(model)
    shapes = {"q_proj": (c.q_size, c.hidden_size), "k_proj": (c.kv_size, c.hidden_size),
              "v_proj": (c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
              "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size)}
    paths = {}
    for k in range(NUM_ADAPTERS):
        g = torch.Generator().manual_seed(k)
        tensors = {}
        for layer in range(c.num_layers):
            for module, (out_f, in_f) in shapes.items():
                parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g) / in_f**0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * 0.02).bfloat16()
        path = out / f"lora-{k}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, task_type="CAUSAL_LM",
                        base_model_name_or_path=str(model)).save_pretrained(str(path))
        paths[f"lora-{k}"] = path
    return paths


def merged_model(model: Path, adapter: Path, out: Path) -> Path:
    """The base model with one adapter merged into its weights (PEFT's scaled B @ A, in float32)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    shutil.copytree(model, out)
    for weights in out.glob("*.safetensors"):
        tensors = load_file(str(weights))
        for name, t in tensors.items():
            key = f"base_model.model.{name.removesuffix('.weight')}"
            if f"{key}.lora_A.weight" in lora:
                delta = lora[f"{key}.lora_B.weight"].float() @ lora[f"{key}.lora_A.weight"].float()
                tensors[name] = (t.float() + scale * delta).to(t.dtype)
        save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


def engine(model: Path, max_seqs: int, rank: int, loras: dict[str, Path] | None = None) -> Any:
    import torch
    from safetensors.torch import load_file

    from warmstart.runtime import LLM
    from warmstart.runtime.engine.engine import LLMEngine
    from warmstart.runtime.engine.lora import lora_from_peft
    from warmstart.runtime.engine.options import EngineOptions

    options = EngineOptions(dtype="bfloat16", num_kv_blocks=1024, max_num_seqs=max_seqs, enable_prefix_caching=False,
                            max_loras=NUM_ADAPTERS, max_lora_rank=rank)
    eng = LLMEngine.from_hf(model, options, device="cpu")
    if eng.prepack_thread is not None:
        eng.prepack_thread.join()
    for name, path in (loras or {}).items():
        config = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(str(path / "adapter_model.safetensors"))

        def load(name: str = name, config: dict[str, Any] = config, tensors: dict[str, Any] = tensors) -> Any:
            return lora_from_peft(name, config, tensors, eng.config, torch.bfloat16)

        eng.add_lora(name, load, config["r"])
    return LLM(eng)


def burst(
    llm: Any, prompts: list[list[int]], adapters: list[str | None], max_tokens: int, torch_lora: bool = False
) -> tuple[float, float]:
    """(generated tokens/s, median time to first token) of one burst; ``torch_lora``: the LoRA adds on the PyTorch
    path for this burst."""
    from warmstart.runtime import SamplingParams
    from warmstart.runtime.layers.lora import add_lora

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    model = llm.engine.runner.model
    chosen = model.add_lora
    if torch_lora:
        model.add_lora = add_lora
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, adapter=adapters)
        seconds = time.perf_counter() - start
    finally:
        model.add_lora = chosen
    assert all(len(o.token_ids) == max_tokens for o in outs)
    ttft = harness.median(o.timestamps.first_token - o.timestamps.arrival for o in outs)
    return sum(len(o.token_ids) for o in outs) / seconds, ttft


def single_ttft(llm: Any, prompt: list[int], adapter: str | None) -> float:
    from warmstart.runtime import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), adapter=adapter)
    return time.perf_counter() - start


def run_vllm(model: Path, paths: dict[str, Path], prompts: list[list[int]], max_tokens: int, rank: int,
             rounds: int, threads: int, tmp: Path) -> dict[str, Any] | None:
    if not VLLM_PYTHON.is_file():
        print(f"vLLM: no venv at {VLLM_PYTHON} (see benchmarks/peers/README.md); skipped")
        return None
    job = tmp / "vllm-job.json"
    job.write_text(json.dumps({"prompts": prompts, "adapters": {n: str(p) for n, p in paths.items()},
                               "max_tokens": max_tokens, "rank": rank, "rounds": rounds}))
    runner = Path(__file__).resolve().parent / "peers" / "run_vllm_lora.py"
    out = tmp / "vllm-out.json"
    done = subprocess.run([str(VLLM_PYTHON), str(runner), "--model-dir", str(model), "--job", str(job),
                           "--out", str(out)], capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0 or not out.is_file():
        print(f"vLLM failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return {"error": done.stderr[-3000:]}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3)
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--ttft-reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default); on a machine loaded past its cores, 1 is much faster")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build with --enable-lora")
    args = harness.parse(ap)

    import torch

    from warmstart.runtime.layers.lora import add_lora
    from warmstart.runtime.models.config import ModelConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    model = bench_model_dir(args.config)
    vocab = ModelConfig.from_dir(model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(16, vocab - 16) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    names = [f"lora-{k}" for k in range(NUM_ADAPTERS)]
    mixed: list[str | None] = [names[i % NUM_ADAPTERS] for i in range(args.requests)]
    none: list[str | None] = [None] * args.requests
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        paths = save_adapters(model, tmp / "adapters", args.rank)
        lora_llm = engine(model, args.requests, args.rank, paths)
        merged_llm = engine(merged_model(model, paths[names[0]], tmp / "merged"), args.requests, args.rank)
        kernel = lora_llm.engine.runner.model.add_lora is not add_lora
        arms = {"mixed": (lora_llm, mixed, False), "mixed-torch": (lora_llm, mixed, True),
                "base": (lora_llm, none, False), "merged": (merged_llm, none, False)}
        for llm, adapters, torch_path in arms.values():  # warm-up: every adapter paged in, every path run once
            burst(llm, prompts[:NUM_ADAPTERS], adapters[:NUM_ADAPTERS], 2, torch_path)
        rates: dict[str, list[float]] = {k: [] for k in arms}
        ttfts: dict[str, list[float]] = {k: [] for k in arms}
        order = list(arms)
        for r in range(args.rounds):
            for key in order[r % len(order) :] + order[: r % len(order)]:
                llm, adapters, torch_path = arms[key]
                rate, ttft = burst(llm, prompts, adapters, args.max_tokens, torch_path)
                rates[key].append(rate)
                ttfts[key].append(ttft)
        single: dict[str, list[float]] = {"adapter": [], "base": []}
        for i in range(args.ttft_reps):
            probe = [rng.randrange(16, vocab - 16) for _ in range(args.prompt_tokens)]
            single["base"].append(single_ttft(lora_llm, probe, None))
            single["adapter"].append(single_ttft(lora_llm, probe, names[i % NUM_ADAPTERS]))
        stats = lora_llm.engine.loras.stats
        del lora_llm, merged_llm
        threads = args.threads or torch.get_num_threads()
        vllm = (run_vllm(model, paths, prompts, args.max_tokens, args.rank, args.rounds, threads, tmp)
                if args.vllm else None)
    per_round = [m / b for m, b in zip(rates["mixed"], rates["base"], strict=True)]
    torch_per_round = [m / b for m, b in zip(rates["mixed-torch"], rates["base"], strict=True)]
    med = {k: harness.median(v) for k, v in rates.items()}
    result = {
        "model": args.config.stem, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "rank": args.rank, "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(), "tok_s": rates, "ttft_s": ttfts,
        "mixed_over_base_per_round": per_round, "mixed_over_base": harness.median(per_round),
        "lora_kernel": kernel, "mixed_torch_over_base_per_round": torch_per_round,
        "mixed_torch_over_base": harness.median(torch_per_round),
        "merged_over_base": harness.median(m / b for m, b in zip(rates["merged"], rates["base"], strict=True)),
        "single_ttft_base_s": harness.median(single["base"]),
        "single_ttft_adapter_s": harness.median(single["adapter"]),
        "adapter_loads": stats.loads, "adapter_load_s": stats.load_seconds, "vllm": vllm,
    }
    print(f"{args.requests} requests of {args.prompt_tokens} prompt tokens, {args.max_tokens} generated each, "
          f"{args.config.stem} (random bf16), rank {args.rank}, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads")
    mixed_label = "8 adapters mixed, C kernel" if kernel else "8 adapters mixed (no kernel)"
    for key, label in (("mixed", mixed_label), ("mixed-torch", "8 adapters mixed, PyTorch"), ("base", "base alone"),
                       ("merged", "one adapter merged")):
        rounds = " ".join(f"{x:7.1f}" for x in rates[key])
        print(f"  {label:28s} tok/s median {med[key]:7.1f} (rounds {rounds}), burst TTFT median "
              f"{harness.median(ttfts[key]) * 1e3:6.0f} ms")
    print(f"  mixed/base per round: {' '.join(f'{x:.3f}' for x in per_round)}; median "
          f"{result['mixed_over_base']:.3f} (goal >= 0.8); merged/base {result['merged_over_base']:.3f}")
    print(f"  mixed-torch/base per round: {' '.join(f'{x:.3f}' for x in torch_per_round)}; median "
          f"{result['mixed_torch_over_base']:.3f}")
    print(f"  one fresh prompt alone, time to first token: base {result['single_ttft_base_s'] * 1e3:.1f} ms, "
          f"behind an adapter {result['single_ttft_adapter_s'] * 1e3:.1f} ms")
    print(f"  adapter loads {stats.loads}, {stats.load_seconds * 1e3:.1f} ms in all")
    if vllm and "error" not in vllm:
        print(f"  vLLM CPU --enable-lora: mixed {vllm['mixed_tok_s']:.1f} tok/s, base {vllm['base_tok_s']:.1f} tok/s, "
              f"its mixed/base per round {' '.join(f'{x:.3f}' for x in vllm['mixed_over_base_per_round'])}; "
              f"ours/vLLM mixed {med['mixed'] / vllm['mixed_tok_s']:.2f}x")
    harness.report(args, result)


if __name__ == "__main__":
    main()
