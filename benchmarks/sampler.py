"""Drawing one token per row from a batch of distributions: inverse CDF (the sampler's) against the
exponential race it replaced, side by side.

    python benchmarks/sampler.py [--rows 40] [--vocab 49152] [--reps 20]

Both sample exactly from p; the race draws an exponential number per vocabulary entry, the inverse CDF one
uniform number per row plus a cumulative sum.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.sampler import inverse_cdf  # noqa: E402


def race(probs: torch.Tensor) -> torch.Tensor:
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def icdf(probs: torch.Tensor) -> torch.Tensor:
    return inverse_cdf(probs, torch.rand(probs.shape[0], 1, dtype=torch.float64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    probs = torch.softmax(torch.randn(args.rows, args.vocab), dim=-1)
    times: dict[str, list[float]] = {"exponential race": [], "inverse CDF": []}
    for _ in range(args.reps):
        for name, draw in (("exponential race", race), ("inverse CDF", icdf)):
            t = time.perf_counter()
            draw(probs)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{args.rows} rows x {args.vocab} tokens, {torch.get_num_threads()} threads, medians of {args.reps}")
    for name, ms in med.items():
        print(f"  {name:18s} {ms:7.2f} ms")
    print(f"  inverse CDF is {med['exponential race'] / med['inverse CDF']:.1f}x faster")


if __name__ == "__main__":
    main()
