"""Prefill attention alone: the C kernel over the pool in place against SDPA (on gathered blocks behind a cached
prefix), one layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64), block size 16.

    OMP_NUM_THREADS=2 python -m benchmarks.prefill_attention [--rounds 7] [--dtype bfloat16|float32] [--json OUT]

Shapes as in benchmarks/prefill.py: short (8 fresh chunks of 450 tokens), cached (8 chunks of 100 tokens behind 900
cached ones), long (one fresh chunk of 2,000). Each round times one call of each path on the same inputs, the order
alternating; printed: the medians and the median of the per-round ratios (SDPA time / kernel time). The kernel
takes all of a step's chunks in one call, SDPA one call per chunk (as runtime/layers/attention.py runs them).
Then the KV write: the C row copies against index_copy_ for 8, 450 and 2,048 rows.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks import harness
from warmstart.runtime.layers.attention import (
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
    ap = harness.arguments(__doc__, rounds=7, warmup=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = harness.parse(ap)
    dtype = getattr(torch, args.dtype)
    lines = [f"{args.dtype}; ms per layer call, median [min-max] of {args.rounds}",
             "| shape | kernel ms | SDPA ms | SDPA / kernel |", "|---|---|---|---|"]
    result: dict[str, Any] = {"dtype": args.dtype, "attention": {}, "kv_write": {}}
    for name, shape in SHAPES.items():
        run = make_step(*shape, dtype)
        times = harness.alternate({"kernel": lambda: run(True), "sdpa": lambda: run(False)},  # noqa: B023
                                  args.rounds, args.warmup)  # fmt: skip
        ratio = harness.ratio(times["sdpa"], times["kernel"])
        result["attention"][name] = {"seconds": times, "sdpa_over_kernel": ratio}

        def cell(v: list[float]) -> str:
            return f"{harness.median(v) * 1e3:.1f} [{min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}]"

        lines.append(f"| {name} | {cell(times['kernel'])} | {cell(times['sdpa'])} | {ratio['median']:.2f}x |")
    lines += kv_write_rows(args.rounds, dtype, result["kv_write"])
    harness.report(args, result, lines)


def kv_write_rows(rounds: int, dtype: torch.dtype, result: dict[int, Any]) -> list[str]:
    """The KV write: the C row copies (``write_kv``) against ``index_copy_`` (``write_kv_torch``), k and v as views
    of a qkv output, slots scattered over a pool; medians of ``rounds`` x 10 calls each."""
    lines = ["| rows | C write_kv us | index_copy_ us | index_copy_ / C |", "|---|---|---|---|"]
    for rows in (8, 450, 2048):
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
        _, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        k, v = k.view(rows, KV_HEADS, HEAD_DIM), v.view(rows, KV_HEADS, HEAD_DIM)
        cache = torch.zeros(2, KV_HEADS, 1000, BLOCK, HEAD_DIM, dtype=dtype)
        slots = torch.randperm(1000 * BLOCK)[:rows]
        times = harness.alternate({"c": lambda: harness.seconds(lambda: write_kv(cache, k, v, slots)),  # noqa: B023
                                   "torch": lambda: harness.seconds(lambda: write_kv_torch(cache, k, v, slots))},  # noqa: B023
                                  rounds * 10)  # fmt: skip
        c, torch_ = harness.median(times["c"]), harness.median(times["torch"])
        result[rows] = {"c_s": c, "index_copy_s": torch_}
        lines.append(f"| {rows} | {c * 1e6:.0f} | {torch_ * 1e6:.0f} | {torch_ / c:.1f}x |")
    return lines


if __name__ == "__main__":
    main()
