"""Decode attention in length groups against one padded group, side by side in one engine.

    python benchmarks/decode_groups.py [--seqs 40]

SmolLM2-135M shape (random weights, bf16); --seqs requests with prompts of 8-1,024 tokens are prefilled,
then decode steps are timed with runtime.model_runner.DECODE_GROUP_COST_BLOCKS set so that everything is one
group (1e9) and to the split costs 32 / 64 / 128, alternating, 4 rounds of 5 steps; medians and the ratio.
Length groups serve the gather path of runtime/layers/attention.py, so it runs with WARMSTART_CPU_ATTENTION=torch
(the C kernel, the default, needs no groups: benchmarks/decode_attention.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["WARMSTART_CPU_ATTENTION"] = "torch"

import warmstart.runtime.engine.model_runner as model_runner  # noqa: E402
from benchmarks.throughput import model_dir  # noqa: E402
from benchmarks.workloads import SHARED_BENCH  # noqa: E402
from warmstart.runtime import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=40)
    args = ap.parse_args()
    llm = LLM.from_hf(model_dir(SHARED_BENCH / "models" / "smollm2-135m.json"), dtype="bfloat16")
    engine = llm.engine
    rng = random.Random(0)
    for _ in range(args.seqs):
        prompt = [rng.randint(16, 40000) for _ in range(rng.randint(8, 1024))]
        engine.add_request(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    def prefilling() -> bool:
        return any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)

    while engine.scheduler.waiting or prefilling():
        engine.step()
    times: dict[int, list[float]] = {cost: [] for cost in (10**9, 32, 64, 128)}
    for _ in range(4):
        for cost in times:
            model_runner.DECODE_GROUP_COST_BLOCKS = cost
            start = time.perf_counter()
            for _ in range(5):
                engine.step()
            times[cost].append((time.perf_counter() - start) / 5 * 1000)
    one = statistics.median(times[10**9])
    for cost, values in times.items():
        label = "one group" if cost == 10**9 else f"split, cost {cost}"
        print(f"{label:<16} {statistics.median(values):7.1f} ms/step  {one / statistics.median(values):.2f}x")


if __name__ == "__main__":
    main()
