"""Compiled adapters: soft prompts and prefix-tuning vectors served as pinned prefixes of virtual tokens.

A prompt-tuning adapter is a few learned input embeddings; a prefix-tuning adapter is learned per-layer keys
and values. Either way, once compiled (see snapshot/adapters.py), what a request needs is the KV of ``n``
virtual positions in front of its prompt. The engine holds that KV in pinned pool blocks and gives each
adapter ``n`` reserved token ids, negative so they can never be real ones, which go in front of a request's
prompt. From there the ordinary machinery does the work: positions count from the virtual tokens, the
chained block hashes cover them (so two adapters never share a cached block), and the prefix cache serves
the full blocks. A partial last block is copied into each sequence's own first block instead, so that no
sequence ever writes into a shared block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

MAX_VIRTUAL_TOKENS = 1 << 16


@dataclass
class VirtualPrefix:
    """An adapter as loaded into the pool."""

    name: str
    kind: str  # PEFT's type: PROMPT_TUNING, P_TUNING or PREFIX_TUNING
    token_ids: list[int]  # the reserved ids of its virtual positions
    tail_block: int | None  # pinned block holding the last ``num_tokens % block_size`` positions, if any

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def virtual_token_ids(name: str, count: int) -> list[int]:
    """Reserved ids for ``count`` virtual positions of adapter ``name``: negative and distinct per name."""
    if not 1 <= count <= MAX_VIRTUAL_TOKENS:
        raise ValueError(f"an adapter needs 1 to {MAX_VIRTUAL_TOKENS} virtual tokens, got {count}")
    base = 1 + (xxhash.xxh3_64_intdigest(name.encode()) >> 32) * MAX_VIRTUAL_TOKENS
    return [-(base + i) for i in range(count)]


def to_blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-position KV [layers, 2, kv_heads, n, head_dim] -> the pool's block layout
    [layers, 2, kv_heads, ceil(n / block_size), block_size, head_dim], the last block zero-padded."""
    layers, two, kv_heads, n, head_dim = kv.shape
    num_blocks = -(-n // block_size)
    padded = kv.new_zeros(layers, two, kv_heads, num_blocks * block_size, head_dim)
    padded[:, :, :, :n] = kv
    return padded.view(layers, two, kv_heads, num_blocks, block_size, head_dim)


def wasted_slots(num_tokens: int, block_size: int) -> int:
    """Slots of the pinned tail block that no position uses (one block per adapter, not per request)."""
    return -num_tokens % block_size


def alignment_advice(num_tokens: int, block_size: int) -> str:
    """What would make an adapter of ``num_tokens`` virtual tokens fill whole blocks."""
    if wasted_slots(num_tokens, block_size) == 0:
        return f"{num_tokens} virtual tokens fill {num_tokens // block_size} blocks of {block_size}: nothing wasted"
    sizes = [b for b in (8, 16, 32, 64, 128) if num_tokens % b == 0]
    down, up = num_tokens - num_tokens % block_size, num_tokens + wasted_slots(num_tokens, block_size)
    lengths = " or ".join(str(n) for n in (down, up) if n > 0)
    by_size = f"block size {' or '.join(map(str, sizes))}" if sizes else "no common block size (8-128)"
    return f"{by_size} would waste none, as would {lengths} virtual tokens at block size {block_size}"


@dataclass
class AdapterSelector:
    """Picks an adapter for a request: the nearest centroid (by cosine) of mean-pooled input embeddings.

    The centroids are built from example queries at build time (snapshot/adapters.py); the embeddings are
    the base model's own table, so the selector needs no weights of its own, and its cost is one pooled
    lookup and one small matmul, whatever the size of the pool.
    """

    names: list[str]
    centroids: torch.Tensor  # [adapters, hidden] float32, unit rows

    def select(self, token_ids: list[int], embed: torch.Tensor) -> str:
        scores = self.centroids @ pooled_embedding(token_ids, embed)
        return self.names[int(scores.argmax())]


def pooled_embedding(token_ids: list[int], embed: torch.Tensor) -> torch.Tensor:
    """The unit-length mean of the tokens' input embeddings, float32 [hidden]."""
    if not token_ids:
        raise ValueError("cannot choose an adapter for an empty prompt")
    mean = embed.index_select(0, torch.tensor(token_ids, device=embed.device)).float().mean(dim=0).cpu()
    return mean / mean.norm().clamp_min(1e-12)
