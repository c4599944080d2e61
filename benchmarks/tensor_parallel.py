"""Tensor parallelism on the CPU: per-step time split into compute and communication at 1 and 2 ranks, the cost
a vocabulary-split head would add, and the bytes each rank pulls at cold start.

    python benchmarks/tensor_parallel.py [--model qwen2.5-0.5b] [--batch 8] [--prompt 128] [--steps 8] [--rounds 2]

Qwen2.5-0.5B shape (random weights, bf16; SmolLM2-135M's 3 KV heads do not split in 2). Each round runs, one after
the other, one process with 2 torch threads (1 rank, the alternative on these 2 cores) and a group of 2 gloo
ranks of 1 thread each. Each prefills ``--batch`` prompts of ``--prompt`` tokens, then times ``--steps`` decode
steps; rank 0 times its all-reduces (2 per layer) and its step broadcast. After the run the two ranks also time
what a vocabulary-split head would add each decode step (an all-reduce of the embeddings, an all-gather of the
logits) against the half of the head's matmul it would save. ``--bytes`` builds 1- and 2-rank snapshots into a
temporary cache and prints the bytes each rank pulls. Medians over rounds and steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import model_dir  # noqa: E402
from benchmarks.workloads import SHARED_BENCH  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runtime.config import ModelConfig
    from runtime.engine import EngineOptions, LLMEngine
    from runtime.sampling_params import SamplingParams
    from runtime.weights import load_weights

    torch.set_num_threads(args.threads)
    model = model_dir(SHARED_BENCH / "models" / f"{args.model}.json")
    options = EngineOptions(dtype="bfloat16", num_kv_blocks=args.batch * (-(-(args.prompt + args.steps + 4) // 16)),
                            max_num_batched_tokens=args.batch * args.prompt, prepack_weights=False)
    group = None
    if args.world == 1:
        engine = LLMEngine.from_hf(model, options)
    else:
        from runtime.tensor_parallel import TensorParallelGroup, follow, rank_engine, shard_weights

        group = TensorParallelGroup(args.rank, args.world, timeout_s=600)
        config = ModelConfig.from_dir(model)
        shard = shard_weights(load_weights(model, config, torch.bfloat16), config, args.rank, args.world)
        engine = rank_engine(config, shard, None, options, group)
        if not group.is_leader:
            follow(engine.runner, group)
            vocab_split_costs(engine, group, args)
            return {}
    for i in range(args.batch):
        engine.add_request([100 + i + j for j in range(args.prompt)], SamplingParams(max_tokens=args.steps + 2,
                                                                                    ignore_eos=True))
    start = time.perf_counter()
    engine.step()  # the whole batch's prefill in one step
    prefill = time.perf_counter() - start
    steps, reduces, broadcasts = [], [], []
    for _ in range(args.steps):
        before = (group.stats.all_reduce_seconds, group.stats.broadcast_seconds) if group else (0.0, 0.0)
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        if group:
            reduces.append(group.stats.all_reduce_seconds - before[0])
            broadcasts.append(group.stats.broadcast_seconds - before[1])
    out = {"prefill_s": prefill, "step_s": statistics.median(steps),
           "all_reduce_s": statistics.median(reduces) if reduces else 0.0,
           "broadcast_s": statistics.median(broadcasts) if broadcasts else 0.0}
    if group is not None:
        group.stop_followers()
        out.update(vocab_split_costs(engine, group, args))
    return out


def vocab_split_costs(engine: Any, group: Any, args: argparse.Namespace) -> dict[str, float]:
    """What a vocabulary-split embedding and head would add per decode step, and the matmul they would save."""
    import torch
    import torch.distributed as dist

    hidden = engine.config.hidden_size
    vocab = engine.config.vocab_size
    head = engine.runner.model.weights.lm_head
    x = torch.randn(args.batch, hidden, dtype=torch.bfloat16)
    reduce_t, gather_t, full_t, half_t = [], [], [], []
    for _ in range(5):
        t = torch.randn(args.batch, hidden, dtype=torch.bfloat16)
        start = time.perf_counter()
        dist.all_reduce(t)
        reduce_t.append(time.perf_counter() - start)
        part = torch.randn(args.batch, vocab // group.world, dtype=torch.float32)
        parts = [torch.empty_like(part) for _ in range(group.world)]
        start = time.perf_counter()
        dist.all_gather(parts, part)
        gather_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.nn.functional.linear(x, head)
        full_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.nn.functional.linear(x, head[: vocab // group.world])
        half_t.append(time.perf_counter() - start)
    med = statistics.median
    return {"vocab_split_collectives_s": med(reduce_t) + med(gather_t),
            "head_matmul_saved_s": med(full_t) - med(half_t)}


def run_group(args: argparse.Namespace, world: int, threads: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)}
    base = [sys.executable, __file__, "--worker", "--model", args.model, "--batch", str(args.batch), "--prompt",
            str(args.prompt), "--steps", str(args.steps), "--world", str(world), "--threads", str(threads)]
    procs = [subprocess.Popen([*base, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])  # type: ignore[no-any-return]


def snapshot_bytes(args: argparse.Namespace) -> None:
    from snapshot.build import BuildOptions, build_snapshot
    from snapshot.cache import BlobCache

    model = model_dir(SHARED_BENCH / "models" / f"{args.model}.json")
    with tempfile.TemporaryDirectory(dir=Path.home() / ".cache") as tmp:
        for world in (1, 2):
            built = build_snapshot(model, BuildOptions(tensor_parallel=world), BlobCache(Path(tmp) / str(world)))
            per_rank = [sum(built.manifest.blob_sizes(r).values()) for r in range(world)]
            print(f"snapshot for {world} rank(s): {sum(built.manifest.blob_sizes().values()) / 1e6:8.1f} MB in all; "
                  f"each rank pulls {', '.join(f'{b / 1e6:.1f}' for b in per_rank)} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bytes", action="store_true", help="also build snapshots and print bytes pulled per rank")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    model_dir(SHARED_BENCH / "models" / f"{args.model}.json")  # build the random model once, outside the timing
    runs: dict[str, list[dict[str, Any]]] = {"1 rank, 2 threads": [], "2 ranks, 1 thread each": []}
    for _ in range(args.rounds):
        runs["1 rank, 2 threads"].append(run_group(args, 1, 2))
        runs["2 ranks, 1 thread each"].append(run_group(args, 2, 1))
    med = statistics.median
    print(f"{args.model}, bf16, batch {args.batch} x {args.prompt}-token prompts, {args.steps} decode steps, "
          f"{args.rounds} rounds (medians)")
    print(f"{'':<24}{'prefill ms':>11}{'decode step ms':>16}{'all-reduce ms':>15}{'broadcast ms':>14}"
          f"{'compute ms':>12}{'comm share':>12}")
    base_step = med(r["step_s"] for r in runs["1 rank, 2 threads"])
    for label, rs in runs.items():
        step, red, bc = (med(r[k] for r in rs) for k in ("step_s", "all_reduce_s", "broadcast_s"))
        print(f"{label:<24}{med(r['prefill_s'] for r in rs) * 1e3:>11.1f}{step * 1e3:>16.1f}{red * 1e3:>15.1f}"
              f"{bc * 1e3:>14.1f}{(step - red - bc) * 1e3:>12.1f}{(red + bc) / step:>12.0%}")
    two = runs["2 ranks, 1 thread each"]
    print(f"decode step, 2 ranks vs 1 rank: {base_step / med(r['step_s'] for r in two):.2f}x "
          "(>1: tensor parallelism is faster)")
    print(f"a vocabulary-split head would add {med(r['vocab_split_collectives_s'] for r in two) * 1e3:.2f} ms of "
          f"collectives per decode step to save {med(r['head_matmul_saved_s'] for r in two) * 1e3:.2f} ms of "
          "head matmul")
    if args.bytes:
        snapshot_bytes(args)


if __name__ == "__main__":
    main()
