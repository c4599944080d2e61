"""The sampler's logits processing (runtime/engine/penalties.py) per step: every row with repetition,
frequency and presence penalties, a logit_bias, min_tokens and a bad word, against the step's logits alone.

    python benchmarks/penalties.py [--rows 40] [--vocab 49152] [--prompt 1000] [--output 256] [--reps 20]

The penalties work on the (row, token) slots the rows' tokens name, so their cost grows with the tokens,
not with the vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from warmstart.runtime.engine.penalties import adjust_logits  # noqa: E402
from warmstart.runtime.engine.sequence import Sequence  # noqa: E402
from warmstart.runtime.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=a.output + 1, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.1, logit_bias={5: 2.0, 7: -1.0}, min_tokens=a.output + 1,
                            bad_words_token_ids=[[11, 12]])
    seqs = []
    for i in range(a.rows):
        tokens = torch.randint(0, a.vocab, (a.prompt + a.output,), generator=g).tolist()
        seq = Sequence(f"r{i}", tokens, a.prompt, params)
        seq.min_tokens_banned = frozenset({2})
        seqs.append(seq)
    logits = torch.randn(a.rows, a.vocab, generator=g)
    times = []
    for _ in range(a.reps + 3):
        start = time.perf_counter()
        adjust_logits(logits, seqs)
        times.append(time.perf_counter() - start)
    ms = statistics.median(times[3:]) * 1000
    print(f"adjust_logits: {ms:.2f} ms per step (median of {a.reps}), {a.rows} rows x {a.vocab} tokens, "
          f"{a.prompt}-token prompts and {a.output} generated, 1 thread")


if __name__ == "__main__":
    main()
