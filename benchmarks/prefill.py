"""Prompt throughput (prefill) of warmstart against vLLM, side by side, on three prefill shapes.

    python -m benchmarks.prefill [--systems warmstart warmstart-torch vllm] [--rounds 5] [--model-dir DIR]

Every system is one long-lived worker process that loads its engine once (vLLM compiles for ~2 minutes), then
the driver runs the rounds: in each round, each shape goes to every system in turn (the order rotating from round
to round), with prompts drawn fresh for that round so no round hits another's cache. While one system is timed the
others are stopped (SIGSTOP), so that an idle engine (vLLM's processes poll their queues) takes no CPU from it.
Each request asks for one token (the one the prefill produces). Figures: prompt tokens that were not cached / wall
time, medians over the rounds, and the median of the per-round ratios of each system to the first.

Shapes:
- short: 8 fresh prompts of 384-512 tokens
- long: 2 fresh prompts of 1,536-2,048 tokens
- cached: 8 prompts of ~100 new tokens (90-110) behind one 768-1,024-token prefix, prefilled (untimed) first

Systems: `warmstart` (the default CPU path: fused small ops, the C prefill attention), `warmstart-all-rows` (the same
with every row through the last layer's o_proj and MLP, not only the rows whose logits are wanted), `warmstart-sdpa`
(the same with prefill attention on SDPA, WARMSTART_CPU_PREFILL_ATTENTION=torch), `warmstart-torch`
(WARMSTART_CPU_SMALL_OPS=torch and WARMSTART_CPU_PREFILL_ATTENTION=torch: the PyTorch reference ops), `vllm`
(benchmarks/peers/prefill_vllm.py under /work/peers/vllm/.venv or $WARMSTART_VLLM_PYTHON, threads bound to the
first OMP_NUM_THREADS CPUs; skipped with a message when absent).
The model: SmolLM2-135M-Instruct from `warmstart prepare-model smollm2`, in bfloat16 (--model-dir to override).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ("WARMSTART_VLLM_PYTHON", Path("/work/peers/vllm/.venv/bin/python"))
SHAPES = {  # name: (prompts, new tokens range, cached prefix range or None)
    "short": (8, (384, 512), None),
    "long": (2, (1536, 2048), None),
    "cached": (8, (90, 110), (768, 1024)),
}


def draw(shape: str, seed: int, vocab: int = 49152) -> dict[str, Any]:
    count, new, prefix_len = SHAPES[shape]
    rng = random.Random(f"{shape}-{seed}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    prefix = tokens(rng.randint(*prefix_len)) if prefix_len else []
    return {"prefix": prefix or None, "prompts": [prefix + tokens(rng.randint(*new)) for _ in range(count)]}


# -- the warmstart worker (this file with --worker) --------------------------------------------------------


def warmstart_worker(model_dir: str, max_batched: int, all_rows: bool) -> None:
    from warmstart.runtime import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM.from_hf(model_dir, dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=max_batched)
    llm.engine.runner.model.wanted_rows_only = not all_rows
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    llm.generate([[100 + i for i in range(64)]], one)  # warm-up
    ops = llm.engine.runner.model.ops
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0,
                      "small_ops_kernel": getattr(ops, "small_ops_kernel", None),
                      "prefill_attention": os.environ.get("WARMSTART_CPU_PREFILL_ATTENTION")}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job["prefix"]:
            llm.generate([job["prefix"] + [5]], one)  # caches the prefix's full blocks
        t = time.perf_counter()
        outs = llm.generate(job["prompts"], one)
        wall = time.perf_counter() - t
        cached = sum(o.cached_tokens for o in outs)
        print(json.dumps({"wall_s": wall, "cached_tokens": cached}), flush=True)


# -- the driver ---------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        # its own process group, so that the driver can stop it (and vLLM's engine processes) as a whole
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=REPO, start_new_session=True)
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> bool:
        line = self._line()
        if line is None:
            print(f"{self.name}: the worker exited with status {self.proc.wait()} before it was ready",
                  file=sys.stderr)
            return False
        self.info = line
        return True

    def _line(self) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if raw.startswith("{"):
                return dict(json.loads(raw))
        return None

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self._line()
        if reply is None:
            raise SystemExit(f"{self.name}: the worker died (status {self.proc.wait()})")
        return reply

    def pause(self, paused: bool) -> None:
        """SIGSTOP / SIGCONT the worker's process group, so that only the system being timed runs."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start(system: str, args: argparse.Namespace) -> Worker | None:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    if system.startswith("warmstart"):
        env["WARMSTART_CPU_SMALL_OPS"] = "torch" if system == "warmstart-torch" else "kernel"
        env["WARMSTART_CPU_PREFILL_ATTENTION"] = "kernel" if system in ("warmstart", "warmstart-all-rows") else "torch"
        cmd = harness.module_command("benchmarks.prefill", "--worker", "--model-dir", str(args.model_dir),
                                     "--max-num-batched-tokens", str(args.max_num_batched_tokens))
        cmd += ["--all-rows"] if system == "warmstart-all-rows" else []
        return Worker(system, cmd, env)
    if system == "vllm":
        python = Path(os.environ.get(VLLM_PYTHON[0]) or VLLM_PYTHON[1])
        if not python.exists():
            print(f"vllm: skipped, no {python} (see benchmarks/peers/README.md)", file=sys.stderr)
            return None
        cmd = [str(python), str(REPO / "benchmarks" / "peers" / "prefill_vllm.py"), "--model-dir",
               str(args.model_dir)]
        return Worker(system, cmd, env)
    raise SystemExit(f"unknown system {system!r}")


def default_model_dir() -> Path:
    from warmstart.snapshot.prepare_model import prepare_model

    return prepare_model("smollm2", log=lambda m: print(m, file=sys.stderr))


def main() -> None:
    ap = harness.arguments(__doc__, rounds=5)
    ap.add_argument("--systems", nargs="+", default=["warmstart", "warmstart-sdpa", "warmstart-torch", "vllm"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="warmstart's step budget")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--all-rows", action="store_true", help=argparse.SUPPRESS)
    args = harness.parse(ap)
    if args.worker:
        warmstart_worker(str(args.model_dir), args.max_num_batched_tokens, args.all_rows)
        return
    args.model_dir = args.model_dir or default_model_dir()
    workers = [w for w in (start(s, args) for s in args.systems) if w is not None]
    workers = [w for w in workers if w.wait_ready()]
    for w in workers:
        print(f"{w.name}: ready {json.dumps(w.info)}", file=sys.stderr)
    rates: dict[tuple[str, str], list[float]] = {}
    log = []
    try:
        for r in range(args.rounds):
            order = workers[r % len(workers):] + workers[:r % len(workers)]
            for shape in args.shapes:
                job = draw(shape, r)
                new = sum(len(p) for p in job["prompts"]) - (len(job["prefix"]) * len(job["prompts"])
                                                             if job["prefix"] else 0)
                for w in order:
                    for other in workers:
                        other.pause(other is not w)
                    reply = w.run(job)
                    rate = new / reply["wall_s"]
                    rates.setdefault((w.name, shape), []).append(rate)
                    log.append({"round": r, "shape": shape, "system": w.name, "new_tokens": new, **reply})
                    print(f"round {r} {shape:6} {w.name:16} {rate:8.0f} new prompt tok/s  {json.dumps(reply)}",
                          file=sys.stderr)
    finally:
        for w in workers:
            w.pause(False)
            w.close()
    print_table(workers, args.shapes, rates)
    harness.report(args, {"rounds": log})


def print_table(workers: list[Worker], shapes: list[str], rates: dict[tuple[str, str], list[float]]) -> None:
    names = [w.name for w in workers]
    print("| shape | " + " | ".join(f"{n} tok/s (median [min-max])" for n in names) + " | "
          + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for shape in shapes:
        cells, ratios = [], []
        for n in names:
            v = rates.get((n, shape), [])
            cells.append(f"{harness.median(v):,.0f} [{min(v):,.0f}-{max(v):,.0f}]" if v else "-")
        base = rates.get((names[0], shape), [])
        for n in names[1:]:
            v = rates.get((n, shape), [])
            # per-round ratios (same prompts, adjacent in time), then their median
            rs = [b / a for a, b in zip(base, v, strict=False)]
            ratios.append(f"{harness.median(rs):.2f}x" if rs else "-")
        print(f"| {shape} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
