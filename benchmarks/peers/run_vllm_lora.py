"""vLLM's CPU build serving many LoRA adapters (--enable-lora), run as a subprocess by benchmarks/lora.py.

    OMP_NUM_THREADS=2 /work/peers/vllm/.venv/bin/python run_vllm_lora.py --model-dir DIR --job job.json --out out.json

job.json: {"prompts": [[token ids]...], "adapters": {name: PEFT dir}, "max_tokens": N, "rank": R, "rounds": K}.
One offline ``vllm.LLM`` (enable_lora, max_loras = the adapters, max_lora_rank R, enforce_eager, bf16, token ids
straight in, greedy, EOS ignored, prefix caching off) runs K rounds, each (mixed) every request with adapter
i % adapters as a LoRARequest, then (base) the same requests with none. Output: tok/s per round for both and the
per-round ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # as run_vllm.py's default: every CPU, none reserved
        cpus = sorted(os.sched_getaffinity(0))[: max(1, int(os.environ["OMP_NUM_THREADS"]))]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    with open(args.job) as f:
        job = json.load(f)

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    names = list(job["adapters"])
    n = int(job["max_tokens"])
    start = time.perf_counter()
    llm = LLM(model=args.model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              enable_prefix_caching=False, enable_lora=True, max_loras=len(names), max_cpu_loras=len(names),
              max_lora_rank=int(job["rank"]), max_num_seqs=max(16, len(prompts)),
              max_model_len=max(len(x) for x in job["prompts"]) + n + 16, seed=0)
    requests = [LoRARequest(name, i + 1, job["adapters"][name]) for i, name in enumerate(names)]
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
    mixed = [requests[i % len(requests)] for i in range(len(prompts))]
    llm.generate(prompts[: len(requests)], params, lora_request=mixed[: len(requests)], use_tqdm=False)  # warm-up
    load_s = time.perf_counter() - start

    def rate(lora: list | None) -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    rates: dict[str, list[float]] = {"mixed": [], "base": []}
    for _ in range(int(job["rounds"])):
        rates["mixed"].append(rate(mixed))
        rates["base"].append(rate(None))
    import vllm

    result = {"engine": f"vllm {vllm.__version__}", "load_s": load_s, "tok_s": rates,
              "mixed_tok_s": statistics.median(rates["mixed"]), "base_tok_s": statistics.median(rates["base"]),
              "mixed_over_base_per_round": [m / b for m, b in zip(rates["mixed"], rates["base"], strict=True)],
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
