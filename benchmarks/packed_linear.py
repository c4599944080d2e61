"""bf16 F.linear against oneDNN's prepacked weights (runtime/quant/packed_linear.py), side by side.

    python benchmarks/packed_linear.py

SmolLM2-135M's matrices (qkv, gate_up, down, the head) at 1 / 16 / 64 / 256 rows; 7 alternating rounds of
20 calls, medians, the ratio and the largest difference between the two outputs.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from warmstart.runtime.quant.packed_linear import PackedWeight  # noqa: E402

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576), "lm_head": (49152, 576)}


def per_call_us(fn, x: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for _ in range(20):
        fn(x)
    return (time.perf_counter() - start) / 20 * 1e6


def main() -> None:
    torch.manual_seed(0)
    print(f"{'matrix':<20}{'rows':>5}{'F.linear us':>13}{'packed us':>11}{'ratio':>8}{'max diff':>10}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).bfloat16()
        packed = PackedWeight(w)
        for rows in (1, 16, 64, 256):
            x = torch.randn(rows, k).bfloat16()
            diff = (packed.linear(x).float() - F.linear(x, w).float()).abs().max().item()
            plain, fast = [], []
            for _ in range(7):
                plain.append(per_call_us(lambda t, w=w: F.linear(t, w), x))
                fast.append(per_call_us(packed.linear, x))
            a, b = statistics.median(plain), statistics.median(fast)
            print(f"{name + str([n, k]):<20}{rows:>5}{a:>13.0f}{b:>11.0f}{a / b:>7.2f}x{diff:>10.3g}")


if __name__ == "__main__":
    main()
