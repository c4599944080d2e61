"""Decode attention: the C kernel against the gather-and-matmul path, side by side in one engine.

    python -m benchmarks.decode_attention [--seqs 40] [--rounds 4] [--json OUT]

SmolLM2-135M shape (random weights, bf16); --seqs requests with prompts of 8-1,024 tokens are prefilled,
then decode steps are timed, alternating between the kernel (runtime/kernels/cpu_attention.c, all decoding
sequences in one call) and the PyTorch path (the blocks gathered, then two matmuls, in length groups as
the runner makes them for it), --rounds rounds of 5 steps each; medians and the ratio. Both paths compute
the same step on the same pool; the sequences grow by 5 tokens a round either way.
"""

from __future__ import annotations

import random
import sys

from benchmarks import harness
from benchmarks.throughput import model_dir
from benchmarks.workloads import SHARED_BENCH
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.layers.ops import TorchOps


def main() -> None:
    ap = harness.arguments(__doc__, rounds=4, warmup=0)
    ap.add_argument("--seqs", type=int, default=40)
    args = harness.parse(ap)
    llm = LLM.from_hf(model_dir(SHARED_BENCH / "models" / "smollm2-135m.json"), dtype="bfloat16")
    engine = llm.engine
    ops = engine.runner.model.ops
    if not (isinstance(ops, TorchOps) and ops.decode_kernel):
        sys.exit("the C decode kernel is not in use (built without a C compiler, or WARMSTART_CPU_ATTENTION=torch)")
    rng = random.Random(0)
    for _ in range(args.seqs):
        prompt = [rng.randint(16, 40000) for _ in range(rng.randint(8, 1024))]
        engine.add_request(prompt, SamplingParams(max_tokens=10 * (args.rounds + args.warmup) + 10, ignore_eos=True))

    def prefilling() -> bool:
        return any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)

    while engine.scheduler.waiting or prefilling():
        engine.step()
    keys = sum(s.num_tokens for s in engine.scheduler.running)

    def ms_per_step(kernel: bool) -> float:
        ops.decode_kernel = kernel
        return harness.seconds(lambda: [engine.step() for _ in range(5)]) / 5 * 1000

    times = harness.alternate({"kernel": lambda: ms_per_step(True), "gather": lambda: ms_per_step(False)},
                              args.rounds, args.warmup)  # fmt: skip
    ms, ratio = harness.medians(times), harness.ratio(times["gather"], times["kernel"])
    harness.report(args, {"seqs": args.seqs, "pool_tokens": keys, "ms_per_step": ms, "gather_over_kernel": ratio}, [
        f"{args.seqs} decoding sequences, {keys} tokens in the pool, {args.rounds} rounds of 5 steps",
        f"C kernel        {ms['kernel']:7.1f} ms/step", f"gather + matmul {ms['gather']:7.1f} ms/step",
        f"ratio (gather / kernel) {harness.ratio_text(ratio)}"])


if __name__ == "__main__":
    main()
