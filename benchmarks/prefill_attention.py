"""Prefill attention alone: the C kernel over the pool in place against SDPA (on gathered blocks behind a cached
prefix), one layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64), block size 16.

    OMP_NUM_THREADS=2 python benchmarks/prefill_attention.py [--rounds 7] [--dtype bfloat16|float32]

Shapes as in benchmarks/prefill.py: short (8 fresh chunks of 450 tokens), cached (8 chunks of 100 tokens behind 900
cached ones), long (one fresh chunk of 2,000). Each round times one call of each path on the same inputs, the order
alternating; printed: the medians and the median of the per-round ratios (SDPA time / kernel time). The kernel
takes all of a step's chunks in one call, SDPA one call per chunk (as runtime/layers/attention.py runs them).
Then the KV write: the C row copies against index_copy_ for 8, 450 and 2,048 rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from warmstart.runtime.layers.attention import (  # noqa: E402
    AttentionGroup,
    AttentionMetadata,
    paged_attention,
    write_kv,
    write_kv_torch,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = {"short": (8, 0, 450), "cached": (8, 900, 100), "long": (1, 0, 2000)}  # chunks, cached, new tokens


def make_step(chunks: int, cached: int, new: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    blocks = -(-(cached + new) // BLOCK)
    num_blocks = blocks * chunks + 1
    cache = torch.randn(2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    q = torch.randn(chunks * new, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(chunks * new, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(chunks * new, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    groups, slots = [], []
    positions = torch.arange(cached, cached + new)
    for c in range(chunks):
        table = order[c * blocks : (c + 1) * blocks]
        slots.append(table[positions // BLOCK] * BLOCK + positions % BLOCK)
        groups.append(AttentionGroup(rows=slice(c * new, (c + 1) * new), block_tables=table[None],
                                     query_positions=positions, first_key_position=0, is_decode=False,
                                     block_size=BLOCK))  # fmt: skip
    slot_mapping = torch.cat(slots)
    write_kv(cache, k, v, slot_mapping)

    def run(kernel: bool) -> float:
        meta = AttentionMetadata(slot_mapping=slot_mapping, groups=groups)  # fresh: nothing cached between calls
        t = time.perf_counter()
        paged_attention(q, k, v, cache, meta, None, decode_kernel=kernel)
        return time.perf_counter() - t

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"threads {torch.get_num_threads()}, {args.dtype}; ms per layer call, median [min-max] of {args.rounds}")
    print("| shape | kernel ms | SDPA ms | SDPA / kernel |\n|---|---|---|---|")
    for name, shape in SHAPES.items():
        run = make_step(*shape, dtype)
        run(True), run(False)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for kernel in (True, False) if r % 2 == 0 else (False, True):
                times[kernel].append(run(kernel))
        ratios = [s / k for k, s in zip(times[True], times[False], strict=True)]

        def cell(v: list[float]) -> str:
            return f"{statistics.median(v) * 1e3:.1f} [{min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}]"

        print(f"| {name} | {cell(times[True])} | {cell(times[False])} | {statistics.median(ratios):.2f}x |")
    kv_write_rows(args.rounds, dtype)


def kv_write_rows(rounds: int, dtype: torch.dtype) -> None:
    """The KV write: the C row copies (``write_kv``) against ``index_copy_`` (``write_kv_torch``), k and v as views
    of a qkv output, slots scattered over a pool; medians of ``rounds`` x 10 calls each."""
    print("| rows | C write_kv us | index_copy_ us | index_copy_ / C |\n|---|---|---|---|")
    for rows in (8, 450, 2048):
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
        _, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        k, v = k.view(rows, KV_HEADS, HEAD_DIM), v.view(rows, KV_HEADS, HEAD_DIM)
        cache = torch.zeros(2, KV_HEADS, 1000, BLOCK, HEAD_DIM, dtype=dtype)
        slots = torch.randperm(1000 * BLOCK)[:rows]
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds * 10):
            for kernel in (True, False) if r % 2 == 0 else (False, True):
                t = time.perf_counter()
                (write_kv if kernel else write_kv_torch)(cache, k, v, slots)
                times[kernel].append(time.perf_counter() - t)
        c, torch_ = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {rows} | {c * 1e6:.0f} | {torch_ * 1e6:.0f} | {torch_ / c:.1f}x |")


if __name__ == "__main__":
    main()
