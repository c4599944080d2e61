"""Tensor parallelism on the CPU: per-step time split into compute and communication at 1 and 2 ranks, the
head split by vocabulary against a replicated one, and the bytes each rank pulls at cold start.

    python -m benchmarks.tensor_parallel [--model qwen2.5-0.5b] [--batch 8] [--prompt 128] [--steps 8] [--rounds 2]

Qwen2.5-0.5B shape (random weights, bf16; SmolLM2-135M's 3 KV heads do not split in 2). Each round runs, one after
the other, one process with 2 torch threads (1 rank, the alternative on these 2 cores), one with 1 thread, and
two groups of 2 gloo ranks of 1 thread each: the head split by vocabulary (each rank multiplies by half of its
rows, rank 0 gathers the logits: the default) and whole (rank 0 computes the whole head). Each prefills
``--batch`` prompts of ``--prompt`` tokens in one step, then times ``--steps`` decode steps; rank 0 times its
all-reduces (2 per layer), its logits gather and its step broadcast, and the rest of the step is compute (and
the engine's own overhead).
``--bytes`` builds 1- and 2-rank snapshots into a temporary cache and prints the bytes each rank pulls.
Medians over rounds and steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.throughput import model_dir
from benchmarks.workloads import SHARED_BENCH

REPO = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from warmstart.runtime.engine.engine import LLMEngine
    from warmstart.runtime.engine.options import EngineOptions
    from warmstart.runtime.models.config import ModelConfig
    from warmstart.runtime.models.weights import load_weights
    from warmstart.runtime.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    model = model_dir(SHARED_BENCH / "models" / f"{args.model}.json")
    options = EngineOptions(dtype="bfloat16", num_kv_blocks=args.batch * (-(-(args.prompt + args.steps + 4) // 16)),
                            max_num_batched_tokens=args.batch * args.prompt, prepack_weights=False)
    group = None
    if args.world == 1:
        engine = LLMEngine.from_hf(model, options)
    else:
        from warmstart.runtime.engine.tensor_parallel import TensorParallelGroup, follow, rank_engine, shard_weights

        group = TensorParallelGroup(args.rank, args.world, timeout_s=600)
        config = ModelConfig.from_dir(model)
        shard = shard_weights(load_weights(model, config, torch.bfloat16), config, args.rank, args.world)
        engine = rank_engine(config, shard, None, options, group, split_head=not args.replicated_head)
        if not group.is_leader:
            follow(engine.runner, group)
            return {}
    for i in range(args.batch):
        engine.add_request([100 + i + j for j in range(args.prompt)], SamplingParams(max_tokens=args.steps + 2,
                                                                                    ignore_eos=True))
    start = time.perf_counter()
    engine.step()  # the whole batch's prefill in one step
    prefill = time.perf_counter() - start
    keys = ("all_reduce_seconds", "gather_seconds", "broadcast_seconds")
    steps: list[float] = []
    comm: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(args.steps):
        before = [getattr(group.stats, k) if group else 0.0 for k in keys]
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        for k, b in zip(keys, before, strict=True):
            comm[k].append(getattr(group.stats, k) - b if group else 0.0)
    if group is not None:
        group.stop_followers()
    return {"prefill_s": prefill, "step_s": harness.median(steps),
            **{k: harness.median(v) for k, v in comm.items()}}


def run_group(args: argparse.Namespace, world: int, threads: int, replicated_head: bool = False) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)}
    base = harness.module_command("benchmarks.tensor_parallel", "--worker", "--model", args.model, "--batch",
                                  str(args.batch), "--prompt", str(args.prompt), "--steps", str(args.steps), "--world",
                                  str(world), "--threads", str(threads),
                                  *(["--replicated-head"] if replicated_head else []))
    procs = [subprocess.Popen([*base, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])  # type: ignore[no-any-return]


def snapshot_bytes(args: argparse.Namespace) -> None:
    from warmstart.snapshot.build import BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache

    model = model_dir(SHARED_BENCH / "models" / f"{args.model}.json")
    with tempfile.TemporaryDirectory(dir=Path.home() / ".cache") as tmp:
        for world in (1, 2):
            built = build_snapshot(model, BuildOptions(tensor_parallel=world), BlobCache(Path(tmp) / str(world)))
            per_rank = [sum(built.manifest.blob_sizes(r).values()) for r in range(world)]
            print(f"snapshot for {world} rank(s): {sum(built.manifest.blob_sizes().values()) / 1e6:8.1f} MB in all; "
                  f"each rank pulls {', '.join(f'{b / 1e6:.1f}' for b in per_rank)} MB")


def main() -> None:
    ap = harness.arguments(__doc__, rounds=2)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bytes", action="store_true", help="also build snapshots and print bytes pulled per rank")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--replicated-head", action="store_true", help=argparse.SUPPRESS)
    args = harness.parse(ap)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    model_dir(SHARED_BENCH / "models" / f"{args.model}.json")  # build the random model once, outside the timing
    one, one_thread = "1 rank, 2 threads", "1 rank, 1 thread"
    split, whole = "2 ranks, head split", "2 ranks, head whole"
    runs: dict[str, list[dict[str, Any]]] = {one: [], one_thread: [], split: [], whole: []}
    groups = {one: (1, 2, False), one_thread: (1, 1, False), split: (2, 1, False), whole: (2, 1, True)}
    for _ in range(args.rounds):
        for label, (world, threads, replicated) in groups.items():
            runs[label].append(run_group(args, world, threads, replicated_head=replicated))
    med = harness.median
    print(f"{args.model}, bf16, batch {args.batch} x {args.prompt}-token prompts, {args.steps} decode steps, "
          f"{args.rounds} rounds (medians); 2 ranks: 1 thread each")
    print(f"{'':<22}{'prefill ms':>11}{'decode ms':>11}{'all-reduce':>12}{'gather':>8}{'broadcast':>11}"
          f"{'compute':>9}{'comm share':>12}")
    for label, rs in runs.items():
        step, red, gat, bc = (med(r[k] for r in rs) for k in ("step_s", "all_reduce_seconds", "gather_seconds",
                                                              "broadcast_seconds"))
        comm = red + gat + bc
        print(f"{label:<22}{med(r['prefill_s'] for r in rs) * 1e3:>11.1f}{step * 1e3:>11.1f}{red * 1e3:>12.1f}"
              f"{gat * 1e3:>8.1f}{bc * 1e3:>11.1f}{(step - comm) * 1e3:>9.1f}{comm / step:>12.0%}")
    steps = {label: [r["step_s"] for r in rs] for label, rs in runs.items()}
    ratios = {"split_vs_one_rank_2_threads": harness.ratio(steps[one], steps[split]),
              "split_vs_one_rank_1_thread": harness.ratio(steps[one_thread], steps[split]),
              "split_vs_whole_head": harness.ratio(steps[whole], steps[split])}
    print(f"decode step, 2 ranks (head split) vs 1 rank: {ratios['split_vs_one_rank_2_threads']['median']:.2f}x "
          f"(2 threads), {ratios['split_vs_one_rank_1_thread']['median']:.2f}x (1 thread); head split vs whole at "
          f"2 ranks: {ratios['split_vs_whole_head']['median']:.2f}x (>1: the first is faster; medians of the rounds)")
    harness.report(args, {"model": args.model, "batch": args.batch, "prompt": args.prompt, "steps": args.steps,
                          "runs": runs, "ratios": ratios})
    if args.bytes:
        snapshot_bytes(args)


if __name__ == "__main__":
    main()
