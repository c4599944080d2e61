"""Attention over the paged KV pool, in PyTorch ops (the CPU path).

One step's batch is flat: every scheduled token of every sequence in one row. New keys and values are
written to the pool by slot; queries then attend over their sequence's blocks. Decoding sequences (one
query each) are attended together in one call; each prefill chunk gets its own call, so no query is
padded to another's length.

Decode groups on the CPU go to a C kernel (runtime/kernels/cpu_attention.c) that reads each sequence's KV blocks in
place, for exactly its own length; the gather-and-matmul path below remains for other devices and dtypes,
for installs built without a C compiler, and under ``WARMSTART_CPU_ATTENTION=torch``. Prefill chunks go to the
same file's causal prefill kernel, all of a step's chunks in one call, also over the pool in place (no gather of a
cached prefix); ``WARMSTART_CPU_PREFILL_ATTENTION=torch`` keeps them on SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from warmstart.runtime.kernels import isa
from warmstart.runtime.kernels.switches import kernel_chosen

_cpu_attention: ModuleType | None
try:  # built by setup.py; absent where the install had no C compiler
    from warmstart.runtime.kernels import _cpu_attention
except ImportError:  # pragma: no cover - depends on the install
    _cpu_attention = None

CPU_ATTENTION_ENV = "WARMSTART_CPU_ATTENTION"
CPU_PREFILL_ATTENTION_ENV = "WARMSTART_CPU_PREFILL_ATTENTION"


def decode_kernel_serves(device: torch.device, dtype: torch.dtype, heads_per_kv_head: int, head_dim: int) -> bool:
    """Whether the C decode kernel serves this model's pool (``WARMSTART_CPU_ATTENTION=torch`` turns it off)."""
    return (
        kernel_chosen(CPU_ATTENTION_ENV)
        and _cpu_attention is not None
        and device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and heads_per_kv_head <= _cpu_attention.MAX_GROUP
        and head_dim <= _cpu_attention.MAX_HEAD_DIM
    )


def prefill_kernel_vectorized(head_dim: int) -> bool:
    """Whether the prefill kernel runs vector code for this head_dim at the instruction set the kernels use
    (runtime/kernels/isa.py): AVX2 or better for a multiple of 8 (AVX-512's code takes the multiples of 16)."""
    return _cpu_attention is not None and isa.at_least("avx2") and head_dim % 8 == 0


def prefill_kernel_chosen(head_dim: int) -> bool:
    """Whether prefill chunks go to the C kernel where the decode kernel serves the pool: where it runs vector code
    (its portable loop measured 9x slower than SDPA), unless ``WARMSTART_CPU_PREFILL_ATTENTION=torch``."""
    return kernel_chosen(CPU_PREFILL_ATTENTION_ENV) and prefill_kernel_vectorized(head_dim)


@dataclass
class AttentionGroup:
    """Sequences attended in one call: the queries in ``rows`` over the blocks of ``block_tables``."""

    rows: slice | torch.Tensor  # rows of the flat batch: a decode group's [B] indices, a prefill chunk's slice
    block_tables: torch.Tensor  # [B, max_blocks]
    query_positions: torch.Tensor  # [B] or [T]
    first_key_position: int  # position of the first key in the first block of ``block_tables``
    is_decode: bool
    block_size: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    biases: dict[int | None, torch.Tensor] = field(default_factory=dict)
    key_ranges: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _pool_rows: torch.Tensor | None = None

    def pool_rows(self, kv_heads: int, num_blocks: int) -> torch.Tensor:
        """Row ids into a [kv_heads * num_blocks, block] view of a pool, head-major: every head's blocks of
        every sequence. One flat gather along dim 0 copies whole rows; it measured 2-4x faster than
        gathering along the block dimension of the 3-d view."""
        if self._pool_rows is None:
            heads = torch.arange(kv_heads)[:, None] * num_blocks
            self._pool_rows = (heads + self.block_tables.view(1, -1)).view(-1)
        return self._pool_rows

    def key_range(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode: the keys each query attends, as [start, end) indices into its row of ``block_tables``."""
        if window not in self.key_ranges:
            end = (self.query_positions.to(torch.int64) - self.first_key_position + 1).contiguous()
            start = torch.zeros_like(end) if window is None else (end - window).clamp_(min=0)
            self.key_ranges[window] = (start, end)
        return self.key_ranges[window]

    def score_bias(self, window: int | None) -> torch.Tensor:
        """The mask as a float32 bias to add to scores: 0 where allowed, -inf elsewhere."""
        if window not in self.biases:
            allowed = self.mask(window)
            self.biases[window] = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        return self.biases[window]

    def mask(self, window: int | None) -> torch.Tensor:
        """[queries, keys]: causal, and within the window if one is given. Decode: one query per sequence."""
        if window not in self.masks:
            length = self.block_tables.shape[1] * self.block_size
            keys = torch.arange(self.first_key_position, self.first_key_position + length)[None, :]
            q = self.query_positions[:, None]
            allowed = keys <= q
            if window is not None:
                allowed &= keys > q - window
            self.masks[window] = allowed
        return self.masks[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] slot of each new token in the pool (block * block_size + offset)
    groups: list[AttentionGroup]
    # the prefill kernel's (groups, tables, sequences), built at the first layer and reused by the others
    _prefill_args: tuple[list[AttentionGroup], torch.Tensor, torch.Tensor] | None = None

    def prefill_args(self) -> tuple[list[AttentionGroup], torch.Tensor, torch.Tensor]:
        """The prefill chunks (groups of consecutive rows), their block tables padded to one width [S, width],
        and per chunk [first row, queries, first query's position, position of its table's first key]."""
        if self._prefill_args is None:
            groups = [g for g in self.groups if not g.is_decode and isinstance(g.rows, slice)]
            width = max((g.block_tables.shape[1] for g in groups), default=1)
            tables = torch.zeros(len(groups), width, dtype=torch.int64)
            seqs = []
            for i, g in enumerate(groups):
                assert isinstance(g.rows, slice)
                tables[i, : g.block_tables.shape[1]] = g.block_tables[0]
                first, count = g.rows.start or 0, g.query_positions.shape[0]
                seqs.append([first, count, int(g.query_positions[0]), g.first_key_position])
            self._prefill_args = (groups, tables, torch.tensor(seqs, dtype=torch.int64).view(-1, 4))
        return self._prefill_args


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [2, kv_heads, num_blocks, block_size, head_dim]; k, v: [N, kv_heads, head_dim].

    A CPU pool in float32 or bfloat16 is written by the C kernel (row copies, k and v read in place), else by
    ``write_kv_torch``."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    if (
        _cpu_attention is not None
        and cache.device.type == "cpu"
        and cache.is_contiguous()
        and cache.dtype in (torch.float32, torch.bfloat16)
        and k.dtype == v.dtype == cache.dtype
        and k.stride()[1:] == v.stride()[1:] == (head_dim, 1)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
    ):
        _cpu_attention.write_kv(
            cache[0].data_ptr(), cache[1].data_ptr(), k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr(),
            k.shape[0], kv_heads, head_dim, cache.shape[2] * cache.shape[3], k.stride(0), v.stride(0),
            cache.element_size(),
        )  # fmt: skip
        return
    write_kv_torch(cache, k, v, slot_mapping)


def write_kv_torch(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_kv`` in PyTorch ops (the reference, and other devices and dtypes)."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    cache[0].view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    cache[1].view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    decode_kernel: bool = False,
    prefill_kernel: bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [N, heads, D] and this step's k_new, v_new: [N, kv_heads, D] (already in the pool) -> [N, heads * D].

    ``decode_kernel``: decode groups run on the C kernel (see ``decode_kernel_serves``), and prefill chunks on
    its prefill kernel where ``prefill_kernel_chosen``; ``prefill_kernel`` overrides that choice (tests).
    ``scale`` multiplies q.k (default head_dim ** -0.5); ``softcap`` caps the scores (Gemma 2), which neither C
    kernel nor SDPA computes: every group then takes the gather-and-matmul path."""
    n, heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    if softcap is not None:
        decode_kernel = prefill_kernel = False
    kv_heads = cache.shape[1]
    group_size = heads // kv_heads
    whole = len(meta.groups) == 1  # one group holding every row in order: no gather or scatter of rows
    by_kernel: list[AttentionGroup] = []
    if prefill_kernel is None:
        prefill_kernel = decode_kernel and prefill_kernel_chosen(head_dim)
    if prefill_kernel:
        by_kernel, tables, seqs = meta.prefill_args()
    out = q.new_empty(n, heads * head_dim) if not whole or by_kernel else None
    if by_kernel:
        assert out is not None
        _kernel_prefill_attention(out, q, cache, tables, seqs, window, scale)
    for g in meta.groups:
        if by_kernel and any(g is done for done in by_kernel):
            continue
        qg = q if whole else q[g.rows]
        if g.is_decode and decode_kernel:
            o = _kernel_decode_attention(qg, cache, g, window, scale)
        elif g.is_decode:
            batch = g.block_tables.shape[0]
            k, v = _gather_blocks(cache[0], g), _gather_blocks(cache[1], g)
            # [B, heads, D] -> [kv_heads, B, group, D]: the query heads sharing a KV head are rows of one block.
            qd = qg.view(batch, kv_heads, group_size, head_dim).transpose(0, 1)
            o = _decode_attention(qd, k, v, g.score_bias(window)[None, :, None, :], scale, softcap)
            o = o.transpose(0, 1).reshape(batch, heads * head_dim)
        elif softcap is not None:
            o = _softcapped_prefill_attention(qg, cache, g, window, scale, softcap)
        else:
            o = _prefill_attention(qg, k_new[g.rows], v_new[g.rows], cache, g, window, scale)
        if out is None:
            return o
        out[g.rows] = o
    assert out is not None
    return out


def _prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: torch.Tensor,
    g: AttentionGroup,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk of T queries [T, heads, D] -> [T, heads * D]."""
    t, heads, head_dim = q.shape
    gqa = heads != cache.shape[1]
    start = int(g.query_positions[0])
    if start == 0 and (window is None or window >= t):
        # A chunk with nothing before it: plain causal attention over its own keys, no gather and no mask,
        # which lets the kernel skip the masked half.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_new.transpose(0, 1)[None], v_new.transpose(0, 1)[None],
            is_causal=True, enable_gqa=gqa, scale=scale,
        )
    else:
        k, v = _gather_blocks(cache[0], g), _gather_blocks(cache[1], g)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=g.mask(window)[None, None], enable_gqa=gqa, scale=scale,
        )
    return o[0].transpose(0, 1).reshape(t, heads * head_dim)


def _softcapped_prefill_attention(
    q: torch.Tensor, cache: torch.Tensor, g: AttentionGroup, window: int | None, scale: float, softcap: float
) -> torch.Tensor:
    """One sequence's chunk of T queries [T, heads, D] -> [T, heads * D] by ``_decode_attention`` over its gathered
    blocks: the query heads sharing a KV head become rows of one block, head by head."""
    t, heads, head_dim = q.shape
    kv_heads = cache.shape[1]
    group = heads // kv_heads
    k, v = _gather_blocks(cache[0], g), _gather_blocks(cache[1], g)  # [kv_heads, 1, L, D]
    queries = q.view(t, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, 1, group * t, head_dim)
    bias = g.score_bias(window).repeat(group, 1)[None, None]  # [1, 1, group * T, L]
    o = _decode_attention(queries, k, v, bias, scale, softcap)
    return o.view(kv_heads, group, t, head_dim).permute(2, 0, 1, 3).reshape(t, heads * head_dim)


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """q: [kv_heads, B, group, D]; k, v: [kv_heads, B, L, D]; bias broadcasts to [kv_heads, B, group, L].
    ``softcap``: the float32 scores become softcap * tanh(scores / softcap) before the mask.

    Two batched matmuls with a float32 softmax: on the CPU this measured several times faster in bfloat16
    than SDPA's flash kernel for single-token queries, and as fast in float32.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.matmul((scores + bias).softmax(dim=-1).to(q.dtype), v)


def _kernel_decode_attention(
    q: torch.Tensor, cache: torch.Tensor, g: AttentionGroup, window: int | None, scale: float
) -> torch.Tensor:
    """q: [B, heads, D] -> [B, heads * D], by runtime/kernels/cpu_attention.c over the pool in place."""
    assert _cpu_attention is not None and cache.is_contiguous() and q.dtype == cache.dtype
    batch, heads, head_dim = q.shape
    _, kv_heads, num_blocks, block_size, _ = cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = g.block_tables.to(torch.int64).contiguous()
    start, end = g.key_range(window)
    _cpu_attention.decode(
        out.data_ptr(), q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(),
        tables.data_ptr(), start.data_ptr(), end.data_ptr(),
        batch, heads, kv_heads, head_dim, block_size, tables.shape[1], num_blocks * block_size * head_dim,
        scale, int(q.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    return out.view(batch, heads * head_dim)


def _kernel_prefill_attention(
    out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, seqs: torch.Tensor,
    window: int | None, scale: float,
) -> None:  # fmt: skip
    """The chunks ``seqs`` describes (see ``AttentionMetadata.prefill_args``): their rows of q [N, heads, D] attend
    causally over the pool in place, into the same rows of out [N, heads * D]; runtime/kernels/cpu_attention.c."""
    assert _cpu_attention is not None and cache.is_contiguous() and out.is_contiguous() and q.dtype == cache.dtype
    _, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:  # a view of the qkv output keeps its row stride
        q = q.contiguous()
    _, kv_heads, num_blocks, block_size, _ = cache.shape
    _cpu_attention.prefill(
        out.data_ptr(), q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), tables.data_ptr(), seqs.data_ptr(),
        seqs.shape[0], heads, kv_heads, head_dim, block_size, tables.shape[1], num_blocks * block_size * head_dim,
        q.stride(0), out.stride(0), window or 0, scale, int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )  # fmt: skip


def _gather_blocks(pool: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """[kv_heads, num_blocks, block_size, D] -> [kv_heads, B, n * block_size, D] for the group's [B, n] blocks.

    Head-major, so each head's keys come out contiguous and the score matmul needs no further copy.
    """
    kv_heads, num_blocks, block_size, head_dim = pool.shape
    rows = pool.view(kv_heads * num_blocks, -1).index_select(0, g.pool_rows(kv_heads, num_blocks))
    return rows.view(kv_heads, g.block_tables.shape[0], -1, head_dim)
