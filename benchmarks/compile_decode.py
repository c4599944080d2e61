"""torch.compile of the decode step against eager, side by side, on the CPU path.

    python benchmarks/compile_decode.py [--seqs 8] [--prompt 200] [--steps 30]

SmolLM2-135M shape (random weights, bf16). For each mode a fresh engine prefills --seqs requests of --prompt
tokens, then runs decode steps through the engine's own loop (so the context grows and block tables widen
as in serving): the first step is timed alone (for the compiled mode: Inductor's compile), then --steps more.
Modes: eager as the engine runs by default (weights prepacked for the CPU's matmul), eager without
prepacked weights, and ``torch.compile(model.forward)`` without prepacking (Inductor fuses the elementwise
ops and picks its own matmuls), with static shapes (the default) and with ``dynamic=True``. The prefill
phase is timed too: a compiled forward compiles its prefill shapes there. Prints seconds of prefill, the
first decode step, ms per later step, and the ratio of ms/step to the default.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import model_dir  # noqa: E402
from benchmarks.workloads import SHARED_BENCH  # noqa: E402
from warmstart.runtime import LLM, SamplingParams  # noqa: E402

MODES = ("eager, prepacked (default)", "eager", "compiled", "compiled, dynamic=True")


def run(mode: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """(prefill s, first decode step s, median ms per later step)."""
    path = model_dir(SHARED_BENCH / "models" / "smollm2-135m.json")
    llm = LLM.from_hf(path, dtype="bfloat16", prepack_weights=mode == "eager, prepacked (default)")
    engine = llm.engine
    if engine.prepack_thread is not None:
        engine.prepack_thread.join()
    model = engine.runner.model
    if mode.startswith("compiled"):
        model.forward = torch.compile(model.forward, dynamic=mode.endswith("dynamic=True") or None)  # type: ignore[method-assign]
    rng = random.Random(0)
    for _ in range(args.seqs):
        prompt = [rng.randint(16, 40000) for _ in range(args.prompt)]
        engine.add_request(prompt, SamplingParams(max_tokens=args.steps + 8, ignore_eos=True))
    def prefilling() -> bool:
        return any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)

    start = time.perf_counter()
    while engine.scheduler.waiting or prefilling():
        engine.step()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    engine.step()
    first = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1000)
    return prefill, first, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    results = {mode: run(mode, args) for mode in MODES}
    base = results[MODES[0]][2]
    threads = torch.get_num_threads()
    print(f"SmolLM2-135M shape, bf16, {args.seqs} sequences of {args.prompt} tokens, {threads} threads")
    print(f"{'mode':<28} {'prefill s':>9} {'1st step s':>10} {'ms/step':>8} {'vs default':>10}")
    for mode, (prefill, first, ms) in results.items():
        print(f"{mode:<28} {prefill:9.2f} {first:10.2f} {ms:8.1f} {base / ms:9.2f}x")


if __name__ == "__main__":
    main()
