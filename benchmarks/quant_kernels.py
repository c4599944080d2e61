"""Quantized matmul kernels against the bf16 matmul, side by side, on SmolLM2-135M's linear shapes.

    python -m benchmarks.quant_kernels [--rows 1 16 64 256] [--rounds 7] [--group-size 128] [--json OUT]

For each shape and row count (tokens in the step) every candidate runs in turn, round after round, so that
load from other processes on the machine spreads over all of them; medians of the per-call times are printed
with the ratio to bf16 F.linear (> 1: slower). Candidates:

- int8  fused:     aten._weight_int8pack_mm
        converted: int8 converted to bf16 into a reused buffer, bf16 matmul, scales applied to the output
- int4  fused:     aten._weight_int4pack_mm_for_cpu (weights in its packed layout)
        converted: codes unpacked from that layout, scaled in float32, converted to bf16, bf16 matmul
- nf4   decode:    two bytes -> four codes through a lookup table into a reused buffer, times the block's
                   absmax, bf16 matmul (what the runtime does)
        grouped:   the same decode without the absmax pass; one matmul per block of input features, the
                   absmax applied to the [blocks, rows, out] partial products, which are then summed
- runtime: what ``runtime.layers.linear.linear`` picks for that row count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks import harness
from warmstart.runtime.layers.linear import linear
from warmstart.runtime.quant import formats as quant
from warmstart.runtime.quant.quantize import quantize

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def nf4_grouped(w: quant.NF4Weight, x: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    table, _ = quant._nf4_table(x.dtype)
    codes = torch.index_select(table, 0, w.packed.view(torch.uint16).reshape(-1).long()).view(x.dtype)
    blocks = k // w.group_size
    codes = codes.view(n, blocks, w.group_size).transpose(0, 1)  # [blocks, N, group]
    partial = torch.bmm(x.view(-1, blocks, w.group_size).transpose(0, 1), codes.transpose(1, 2))
    return (partial * w.absmax.t()[:, None, :]).sum(0)


def candidates(weight: torch.Tensor, group_size: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    i8 = quantize(weight, "int8")
    i4 = quantize(weight, "int4", group_size)
    nf = quantize(weight, "nf4", 64)
    assert isinstance(i8, quant.Int8Weight) and isinstance(i4, quant.Int4Weight) and isinstance(nf, quant.NF4Weight)
    return {
        "bf16": lambda x: F.linear(x, weight),
        "int8 fused": i8.fused,
        "int8 converted": i8.converted,
        "int8 runtime": lambda x: linear(x, i8),
        "int4 fused": i4.fused,
        "int4 converted": i4.converted,
        "int4 runtime": lambda x: linear(x, i4),
        "nf4 decode": nf.linear,
        "nf4 grouped": lambda x: nf4_grouped(nf, x),
    }


def per_call_us(fn: Callable[[], object], budget_s: float = 0.02) -> float:
    """Median over a few calls of one call's time, in microseconds."""
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return harness.median(times) * 1e6


def main() -> None:
    ap = harness.arguments(__doc__, rounds=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--group-size", type=int, default=64,
                    help="int4 group size (64: the largest that divides SmolLM2's 576; nf4 uses its default 64)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = harness.parse(ap)

    torch.manual_seed(0)
    report: dict[str, dict[str, dict[str, float]]] = {}
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu}, int4 group {args.group_size}, "
          f"nf4 block 64; microseconds per call (median of {args.rounds} rounds), ratio to bf16")
    with torch.inference_mode():
        for shape_name in args.shapes:
            n, k = SHAPES[shape_name]
            weight = (torch.randn(n, k) / k**0.5).bfloat16()
            fns = candidates(weight, args.group_size)
            report[shape_name] = {}
            print(f"\n{shape_name} [{n}, {k}]")
            print(f"{'rows':>5}" + "".join(f"{name:>16}" for name in fns))
            for m in args.rows:
                x = torch.randn(m, k).bfloat16()
                for fn in fns.values():
                    fn(x)  # warm-up: buffers, tables
                samples: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(args.rounds):
                    for name, fn in fns.items():
                        samples[name].append(per_call_us(lambda fn=fn, x=x: fn(x)))  # type: ignore[misc]
                med = {name: harness.median(v) for name, v in samples.items()}
                report[shape_name][str(m)] = med
                cells = [f"{med['bf16']:>16.0f}"]
                cells += [f"{med[name]:>9.0f} {med[name] / med['bf16']:>5.2f}x" for name in fns if name != "bf16"]
                print(f"{m:>5}" + "".join(cells))
    harness.report(args, report)


if __name__ == "__main__":
    main()
