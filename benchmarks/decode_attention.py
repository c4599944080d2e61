"""Decode attention: the C kernel against the gather-and-matmul path, side by side in one engine.

    python benchmarks/decode_attention.py [--seqs 40] [--rounds 4]

SmolLM2-135M shape (random weights, bf16); --seqs requests with prompts of 8-1,024 tokens are prefilled,
then decode steps are timed, alternating between the kernel (runtime/kernels/cpu_attention.c, all decoding
sequences in one call) and the PyTorch path (the blocks gathered, then two matmuls, in length groups as
the runner makes them for it), --rounds rounds of 5 steps each; medians and the ratio. Both paths compute
the same step on the same pool; the sequences grow by 5 tokens a round either way.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import model_dir  # noqa: E402
from benchmarks.workloads import SHARED_BENCH  # noqa: E402
from warmstart.runtime import LLM, SamplingParams  # noqa: E402
from warmstart.runtime.layers.ops import TorchOps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    llm = LLM.from_hf(model_dir(SHARED_BENCH / "models" / "smollm2-135m.json"), dtype="bfloat16")
    engine = llm.engine
    ops = engine.runner.model.ops
    if not (isinstance(ops, TorchOps) and ops.decode_kernel):
        sys.exit("the C decode kernel is not in use (built without a C compiler, or WARMSTART_CPU_ATTENTION=torch)")
    rng = random.Random(0)
    for _ in range(args.seqs):
        prompt = [rng.randint(16, 40000) for _ in range(rng.randint(8, 1024))]
        engine.add_request(prompt, SamplingParams(max_tokens=10 * args.rounds + 10, ignore_eos=True))

    def prefilling() -> bool:
        return any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)

    while engine.scheduler.waiting or prefilling():
        engine.step()
    keys = sum(s.num_tokens for s in engine.scheduler.running)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for kernel in times:
            ops.decode_kernel = kernel
            start = time.perf_counter()
            for _ in range(5):
                engine.step()
            times[kernel].append((time.perf_counter() - start) / 5 * 1000)
    kernel_ms, gather_ms = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.seqs} decoding sequences, {keys} tokens in the pool, {args.rounds} rounds of 5 steps")
    print(f"C kernel        {kernel_ms:7.1f} ms/step")
    print(f"gather + matmul {gather_ms:7.1f} ms/step")
    print(f"ratio (gather / kernel) {gather_ms / kernel_ms:.2f}x")


if __name__ == "__main__":
    main()
