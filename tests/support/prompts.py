"""Prompts the engine tests share."""

from __future__ import annotations

import random


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """A dozen-plus requests of different lengths; some share prefixes longer than a block."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 80))] for _ in range(12)]
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 30)]
    prompts.append(shared[:33])  # ends inside a cached block
    return prompts
