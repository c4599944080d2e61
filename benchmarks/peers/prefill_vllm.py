"""vLLM's side of benchmarks/prefill.py: one offline engine, loaded once, that runs the jobs the driver sends.

Run with the vLLM venv's python (benchmarks/peers/README.md). Reads one JSON job per line on stdin
({"prefix": [...] | null, "prompts": [[...], ...]}), prefills the prefix untimed when there is one (prefix
caching on, vLLM's default), then times `LLM.generate` of the prompts with max_tokens=1, and answers one JSON line
({"wall_s", "cached_tokens"}). Threads bound as run_vllm.py's --cpu-bind all: the first OMP_NUM_THREADS CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cpus = sorted(os.sched_getaffinity(0))[: max(1, int(os.environ["OMP_NUM_THREADS"]))]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=16,
              max_model_len=args.max_model_len, enable_prefix_caching=True, seed=0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [100 + i for i in range(64)]}], one, use_tqdm=False)
    sched = llm.llm_engine.vllm_config.scheduler_config
    print(json.dumps({"ready": True, "engine": f"vllm {vllm.__version__}", "load_s": time.perf_counter() - t0,
                      "max_num_batched_tokens": sched.max_num_batched_tokens,
                      "cpu_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job["prefix"]:
            llm.generate([{"prompt_token_ids": job["prefix"] + [5]}], one, use_tqdm=False)
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, one, use_tqdm=False)
        wall = time.perf_counter() - t
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        print(json.dumps({"wall_s": wall, "cached_tokens": cached}), flush=True)


if __name__ == "__main__":
    main()
