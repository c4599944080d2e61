"""Drawing one token per row from a batch of distributions: the sampler's two-level inverse CDF against
one cumulative sum over the whole row (what it was before) and the exponential race (before that), side by
side.

    python benchmarks/sampler.py [--rows 40] [--vocab 49152] [--reps 20]

All three sample exactly from p; the race draws an exponential number per vocabulary entry, the inverse CDFs
one uniform number per row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from warmstart.runtime.engine.sampler import inverse_cdf  # noqa: E402


def race(probs: torch.Tensor) -> torch.Tensor:
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def icdf(probs: torch.Tensor) -> torch.Tensor:
    return inverse_cdf(probs, torch.rand(probs.shape[0], 1, dtype=torch.float64))


def one_cumsum(probs: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_max(probs.shape[1] - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    probs = torch.softmax(3 * torch.randn(args.rows, args.vocab), dim=-1)
    draws = {"exponential race": race, "one cumulative sum": one_cumsum, "two-level inverse CDF": icdf}
    times: dict[str, list[float]] = {name: [] for name in draws}
    for _ in range(args.reps):
        for name, draw in draws.items():
            t = time.perf_counter()
            draw(probs)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{args.rows} rows x {args.vocab} tokens, {torch.get_num_threads()} threads, medians of {args.reps}")
    for name, ms in med.items():
        print(f"  {name:22s} {ms:7.2f} ms")
    two_level = med["two-level inverse CDF"]
    print(f"  two-level is {med['one cumulative sum'] / two_level:.1f}x one cumulative sum, "
          f"{med['exponential race'] / two_level:.1f}x the race")


if __name__ == "__main__":
    main()
