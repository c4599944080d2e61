"""Attention over the paged KV pool, in PyTorch ops (the CPU path).

One step's batch is flat: every scheduled token of every sequence in one row. New keys and values are
written to the pool by slot; queries then attend over their sequence's blocks. Decoding sequences (one
query each) are attended together in one call; each prefill chunk gets its own call, so no query is
padded to another's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences attended in one call: queries ``token_index`` over the blocks of ``block_tables``."""

    token_index: torch.Tensor  # [B] for decode, [T] for one prefill chunk: rows of the flat batch
    block_tables: torch.Tensor  # [B, max_blocks]
    query_positions: torch.Tensor  # [B] or [T]
    first_key_position: int  # position of the first key in the first block of ``block_tables``
    is_decode: bool
    block_size: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """Boolean mask [B or 1, 1, Q, L]: causal, within the context and, if given, within the window."""
        if window not in self.masks:
            length = self.block_tables.shape[1] * self.block_size
            keys = torch.arange(self.first_key_position, self.first_key_position + length)
            q = self.query_positions[:, None]
            allowed = keys[None, :] <= q
            if window is not None:
                allowed &= keys[None, :] > q - window
            # decode: one query row per sequence [B, 1, 1, L]; prefill: one sequence's rows [1, 1, T, L]
            self.masks[window] = allowed[:, None, None, :] if self.is_decode else allowed[None, None, :, :]
        return self.masks[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] slot of each new token in the pool (block * block_size + offset)
    groups: list[AttentionGroup]


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [N, kv_heads, head_dim]."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, window: int | None
) -> torch.Tensor:
    """q: [N, heads, head_dim] -> [N, heads * head_dim]."""
    n, heads, head_dim = q.shape
    kv_heads = cache.shape[3]
    group_size = heads // kv_heads
    whole = len(meta.groups) == 1  # one group holding every row in order: no gather or scatter of rows
    out = q.new_empty(n, heads * head_dim) if not whole else None
    for g in meta.groups:
        batch = g.block_tables.shape[0]
        k = _gather_blocks(cache[0], g.block_tables)
        v = _gather_blocks(cache[1], g.block_tables)
        qg = q if whole else q[g.token_index]
        if g.is_decode:
            # The query heads sharing a KV head ride as rows of one query block: [B, kv_heads, group, D].
            o = F.scaled_dot_product_attention(
                qg.view(batch, kv_heads, group_size, head_dim), k, v, attn_mask=g.mask(window)
            ).reshape(batch, heads * head_dim)
        else:
            o = F.scaled_dot_product_attention(
                qg.transpose(0, 1)[None], k, v, attn_mask=g.mask(window), enable_gqa=group_size > 1
            )[0].transpose(0, 1).reshape(-1, heads * head_dim)
        if out is None:
            return o
        out[g.token_index] = o
    assert out is not None
    return out


def _gather_blocks(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, D] gathered by [B, n] block ids -> [B, kv_heads, n * block_size, D]."""
    num_blocks, block_size, kv_heads, head_dim = pool.shape
    rows = pool.view(num_blocks, -1).index_select(0, block_tables.view(-1))  # whole blocks, one memcpy each
    return rows.view(block_tables.shape[0], -1, kv_heads, head_dim).transpose(1, 2)
