"""Throughput of warmstart's engine against transformers (and vLLM / llama.cpp where installed), side by side.

    python -m benchmarks.throughput [--workload mixed shared-prefix] [--rounds 1] [--scale 1.0]

Each system runs in a fresh subprocess on the same random-weight model (SmolLM2-135M shape, bf16) and the
same requests (../shared/bench/workloads.json), one after the other, round after round; medians and the
ratio to ours are printed. Requests arrive on the workload's schedule (Poisson or burst) for every system.

- warmstart: the engine's step loop; requests are added as they arrive.
- transformers: `generate` in static batches of --hf-batch requests in arrival order, left-padded, each
  batch running to its longest member (the baseline of ../shared/bench/README.md).
- vllm / llama.cpp: benchmarks/peers/run_*.py under their own venvs (WARMSTART_VLLM_PYTHON,
  WARMSTART_LLAMACPP_PYTHON or /work/peers/*/.venv); skipped with a message when absent.

tokens/s = (prompt + generated tokens) / wall time, from the first arrival to the last token.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.workloads import SHARED_BENCH, Request, load_workload, read_requests, save_requests

PEERS = {
    "vllm": ("WARMSTART_VLLM_PYTHON", Path("/work/peers/vllm/.venv/bin/python"), "run_vllm.py"),
    "llama.cpp": ("WARMSTART_LLAMACPP_PYTHON", Path("/work/peers/llamacpp/.venv/bin/python"), "run_llamacpp.py"),
}


def model_dir(config: Path) -> Path:
    from warmstart.runtime.random_model import make_random_model

    out = Path.home() / ".cache" / "warmstart" / "bench" / f"{config.stem}-bf16"
    if not (out / "config.json").is_file():
        make_random_model(out, config, seed=0, dtype="bfloat16")
    return out


# -- workers (run in their own process) -------------------------------------------------------------------


def run_ours(model: Path, requests: list[Request], args: argparse.Namespace) -> dict:
    from warmstart.runtime import LLM, SamplingParams

    llm = LLM.from_hf(model, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate([[20, 21, 22]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    engine = llm.engine
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    ttft: dict[str, float] = {}
    first_at: dict[str, float] = {}
    tpot: list[float] = []
    arrival: dict[str, float] = {}
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(pending) and requests[pending[nxt]].arrival_s <= now:
            r = requests[pending[nxt]]
            rid = engine.add_request(r.prompt_token_ids,
                                     SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
            arrival[rid] = r.arrival_s
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, requests[pending[nxt]].arrival_s - now))
            continue
        for out in engine.step():
            now = time.perf_counter() - t0
            if out.request_id not in first_at:
                first_at[out.request_id] = now
                ttft[out.request_id] = now - arrival[out.request_id]
            if out.finished and len(out.token_ids) > 1:
                tpot.append((now - first_at[out.request_id]) / (len(out.token_ids) - 1))
    wall = time.perf_counter() - t0
    stats = engine.stats()
    return {
        "engine": "warmstart",
        "wall_s": wall,
        "ttft_s": list(ttft.values()),
        "tpot_s": tpot,
        "prefix_hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
        "preemptions": stats.num_preemptions,
    }


def run_transformers(model: Path, requests: list[Request], args: argparse.Namespace) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor

    torch.set_grad_enabled(False)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    pad = 0

    class FirstToken(LogitsProcessor):
        """Records when the first new token's logits exist (the end of the batch's prefill)."""

        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    def generate(batch: list[Request]) -> float | None:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r.prompt_token_ids) for r in batch])[:, None])
        new = max(r.max_tokens for r in batch)
        first = FirstToken()
        hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, eos_token_id=None, pad_token_id=pad, logits_processor=[first])
        return first.at

    generate([Request([20, 21, 22], 2, 0.0)])  # warm-up
    order = sorted(requests, key=lambda r: r.arrival_s)
    ttft, tpot = [], []
    t0 = time.perf_counter()
    for start in range(0, len(order), args.hf_batch):
        batch = order[start : start + args.hf_batch]
        ready = max(r.arrival_s for r in batch)
        time.sleep(max(0.0, ready - (time.perf_counter() - t0)))
        first_at = generate(batch)
        end = time.perf_counter() - t0
        first = (first_at or t0) - t0
        new = max(r.max_tokens for r in batch)
        ttft += [first - r.arrival_s for r in batch]
        tpot += [(end - first) / max(1, new - 1)] * len(batch)
    return {"engine": f"transformers {transformers.__version__} (static batches of {args.hf_batch})",
            "wall_s": time.perf_counter() - t0, "ttft_s": ttft, "tpot_s": tpot}


def worker(args: argparse.Namespace) -> None:
    import torch

    requests = read_requests(Path(args.requests))
    run = run_ours if args.worker == "warmstart" else run_transformers
    result = run(Path(args.model_dir), requests, args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["threads"] = torch.get_num_threads()
    Path(args.out).write_text(json.dumps(result))


# -- orchestration -----------------------------------------------------------------------------------------


def run_system(system: str, model: Path, requests_path: Path, args: argparse.Namespace) -> dict | None:
    out = requests_path.with_suffix(f".{system}.json")
    if system in PEERS:
        env_var, default, script = PEERS[system]
        python = Path(os.environ.get(env_var, default))
        if not python.is_file():
            print(f"  {system}: skipped (no interpreter at {python}; set {env_var}, see benchmarks/peers/README.md)")
            return None
        cmd = [str(python), str(Path(__file__).parent / "peers" / script), "--model-dir", str(model),
               "--requests", str(requests_path), "--out", str(out), "--max-num-seqs", str(args.max_num_seqs)]
    else:
        cmd = harness.module_command("benchmarks.throughput", "--worker", system, "--model-dir", str(model),
                                     "--requests", str(requests_path), "--out", str(out),
                                     "--max-num-seqs", str(args.max_num_seqs), "--hf-batch", str(args.hf_batch),
                                     "--max-num-batched-tokens", str(args.max_num_batched_tokens))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=harness.REPO)
    if proc.returncode != 0:
        print(f"  {system}: failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return None
    return json.loads(out.read_text())


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = harness.arguments(__doc__, rounds=1)
    ap.add_argument("--workload", nargs="+", default=["mixed", "shared-prefix"])
    ap.add_argument("--systems", nargs="+", default=["warmstart", "transformers", "vllm", "llama.cpp"])
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests to run")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--requests", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = harness.parse(ap)
    if args.worker:
        return worker(args)

    config = json.loads(args.config.read_text())
    model = model_dir(args.config)
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workload:
            requests = load_workload(workload, config["vocab_size"], scale=args.scale)
            tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in requests)
            generated = sum(r.max_tokens for r in requests)
            path = Path(tmp) / f"{workload}.json"
            save_requests(requests, path)
            print(f"{workload}: {len(requests)} requests, {tokens} tokens ({generated} generated), "
                  f"{args.rounds} round(s), model {args.config.stem} bf16")
            runs: dict[str, list[dict]] = {s: [] for s in args.systems}
            for _ in range(args.rounds):
                for system in args.systems:
                    result = run_system(system, model, path, args)
                    if result is not None:
                        runs[system].append(result)
            rows = {}
            for system, results in runs.items():
                if not results:
                    continue
                wall = harness.median(r["wall_s"] for r in results)
                last = results[-1]
                rows[system] = {
                    "engine": last["engine"], "wall_s": wall, "total_tok_s": tokens / wall,
                    "gen_tok_s": generated / wall,
                    "ttft_p50_s": pct(last["ttft_s"], 0.5), "ttft_p99_s": pct(last["ttft_s"], 0.99),
                    "tpot_p50_s": pct(last.get("tpot_s", []), 0.5), "tpot_p99_s": pct(last.get("tpot_s", []), 0.99),
                    "peak_rss_mib": last.get("peak_rss_mib"),
                }
            base = rows.get("warmstart")
            print(f"{'system':<14}{'tok/s':>9}{'gen tok/s':>11}{'ratio':>8}{'TTFT p50':>10}{'p99':>8}"
                  f"{'TPOT p50':>10}{'p99':>8}{'RSS MiB':>9}")
            for system, row in rows.items():
                ratio = base["total_tok_s"] / row["total_tok_s"] if base else float("nan")
                row["warmstart_speedup"] = ratio
                print(f"{system:<14}{row['total_tok_s']:>9.0f}{row['gen_tok_s']:>11.0f}{ratio:>7.2f}x"
                      f"{row['ttft_p50_s']:>10.2f}{row['ttft_p99_s']:>8.2f}{row['tpot_p50_s']:>10.3f}"
                      f"{row['tpot_p99_s']:>8.3f}{row['peak_rss_mib'] or 0:>9.0f}")
            print("  ratio = warmstart tok/s / this system's tok/s")
            report[workload] = rows
    harness.report(args, report)


if __name__ == "__main__":
    main()
