"""Attention over the paged KV pool: decode (with a split-K, flash-decoding variant) and prefill / chunked
prefill over a cached prefix, one kernel for both.

The pool is the engine's: [2 (K, V), kv_heads, num_blocks, block_size, head_dim], head-major. A sequence's
keys are found through its row of ``block_tables``, whose first column holds the key at
``first_key_position`` (the engine drops blocks wholly outside a sliding window). Its queries are the last
``q_len`` of its ``seq_len`` positions (the new keys are already in the pool), attended causally and, with a
window, only to the last ``window`` positions.

A program takes one tile of queries of one sequence and every query head sharing one KV head (GQA: the
keys are loaded once for the group), and walks the sequence's keys a tile at a time with an online softmax.
Key tiles are independent of the pool's block size: each key's block is looked up on its own, so block
sizes below the 16 rows ``tl.dot`` needs work too. Decode is the same kernel with one query per tile; for
long contexts with few sequences its key range is split over several programs whose partial results
(running max, sum, weighted values) a second kernel combines.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from warmstart.runtime.kernels.dot import dot

    HAVE_TRITON = True
except ImportError:  # the kernels are then unavailable; runtime/layers' references still work
    HAVE_TRITON = False

from warmstart.runtime.kernels import require_triton

# Programs enough to fill a large GPU; below this many (sequences x KV heads), decode splits its keys.
TARGET_PROGRAMS = 256
MIN_TILES_PER_SPLIT = 4


def paged_attention_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    first_key_position: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, heads, D], sequence s's queries in rows query_start[s]:query_start[s+1] -> [T, heads, D].

    Sequence by sequence: its keys gathered from the pool in order, a float32 masked softmax.
    """
    kv_heads, head_dim = cache.shape[1], cache.shape[4]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    for s in range(block_tables.shape[0]):
        q0, q1, seq_len = int(query_start[s]), int(query_start[s + 1]), int(seq_lens[s])
        k = cache[0][:, block_tables[s]].reshape(kv_heads, -1, head_dim).float().repeat_interleave(group, 0)
        v = cache[1][:, block_tables[s]].reshape(kv_heads, -1, head_dim).float().repeat_interleave(group, 0)
        keys = torch.arange(k.shape[1]) + first_key_position
        queries = torch.arange(seq_len - (q1 - q0), seq_len)
        allowed = keys[None, :] <= queries[:, None]
        if window is not None:
            allowed &= keys[None, :] > queries[:, None] - window
        scores = q[q0:q1].float().transpose(0, 1) @ k.transpose(1, 2) * head_dim**-0.5
        probs = scores.masked_fill(~allowed.to(q.device), float("-inf")).softmax(-1)
        out[q0:q1] = (probs @ v).transpose(0, 1).to(q.dtype)
    return out


if HAVE_TRITON:

    @triton.jit
    def paged_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr, cache_ptr, tables_ptr, query_start_ptr, seq_lens_ptr, tile_seq_ptr, tile_query_ptr,
        out_ptr, part_max_ptr, part_sum_ptr,
        first_key_position, window, scale, softcap, table_width, cache_kv_stride, cache_head_stride,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_K: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
        first_query = tl.load(tile_query_ptr + tile)
        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        seq_len = tl.load(seq_lens_ptr + seq)

        # Rows of this tile: BLOCK_Q queries x the GROUP query heads of this KV head (padded to GROUP_PAD).
        r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        query = first_query + r // GROUP_PAD
        head = kv_head * GROUP + r % GROUP_PAD
        row_ok = (query < q_len) & (r % GROUP_PAD < GROUP)
        position = seq_len - q_len + query  # of each query in its sequence
        dims = tl.arange(0, D_PAD)
        dim_ok = dims < HEAD_DIM
        q_offs = ((q_begin + query) * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

        # Keys any row may see: from the first query's window start to the last query's position.
        last_position = seq_len - q_len + tl.minimum(first_query + BLOCK_Q, q_len) - 1
        lowest = first_key_position
        if window > 0:
            lowest = tl.maximum(lowest, seq_len - q_len + first_query - window + 1)
        tile_begin = (lowest - first_key_position) // TILE_K
        tile_end = (last_position - first_key_position) // TILE_K + 1
        per_split = tl.cdiv(tile_end - tile_begin, NUM_SPLITS)
        tile_begin += split * per_split
        tile_end = tl.minimum(tile_end, tile_begin + per_split)

        m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)
        table = tables_ptr + seq * table_width
        k_base = cache_ptr + kv_head.to(tl.int64) * cache_head_stride  # a large pool's offsets pass 2^31
        for t in range(tile_begin, tile_end):
            key = t * TILE_K + tl.arange(0, TILE_K)  # index into the table's keys
            key_position = first_key_position + key
            key_ok = (key_position <= last_position) & (key < table_width * BLOCK_SIZE)
            block = tl.load(table + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            kv_offs = (block * BLOCK_SIZE + key % BLOCK_SIZE)[:, None] * HEAD_DIM + dims[None, :]
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(k_base + cache_kv_stride + kv_offs, mask=kv_mask, other=0.0)

            scores = dot(q, tl.trans(k)) * scale
            if softcap > 0:  # Gemma 2's: softcap * tanh(scores / softcap), tanh written with exp
                scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
            allowed = key_ok[None, :] & (key_position[None, :] <= position[:, None])
            if window > 0:
                allowed &= key_position[None, :] > position[:, None] - window
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v)
            m = m_new

        row = (q_begin + query) * NUM_HEADS + head
        if NUM_SPLITS == 1:
            out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
            o_offs = row[:, None] * HEAD_DIM + dims[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:  # partial results, [T, heads, splits, (D)], combined by combine_splits_kernel
            part = row * NUM_SPLITS + split
            tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
            tl.store(part_max_ptr + part, m, mask=row_ok)
            tl.store(part_sum_ptr + part, total, mask=row_ok)

    @triton.jit
    def combine_splits_kernel(  # type: ignore[no-untyped-def]
        part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)  # one (query, head)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, D_PAD)
        split_ok = splits < NUM_SPLITS
        m = tl.load(part_max_ptr + row * NUM_SPLITS + splits, mask=split_ok, other=float("-inf"))
        total = tl.load(part_sum_ptr + row * NUM_SPLITS + splits, mask=split_ok, other=0.0)
        offs = (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :]
        acc = tl.load(part_out_ptr + offs, mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        weight = tl.exp(m - tl.max(m, 0))  # an empty split has max -inf: weight 0
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
        tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def tile_config(head_dim: int, group: int, is_decode: bool) -> tuple[int, int, int]:
    """(GROUP_PAD, BLOCK_Q, TILE_K): rows = BLOCK_Q x GROUP_PAD of at least 16 (tl.dot's minimum), about 64
    for prefill; key tiles smaller for wide heads to keep [rows, TILE_K] and [TILE_K, head_dim] in registers."""
    group_pad = triton.next_power_of_2(group)
    if is_decode:
        return max(16, group_pad), 1, 64 if head_dim <= 64 else 32
    return group_pad, max(1, 64 // group_pad), 32


def choose_num_splits(programs: int, key_tiles: int) -> int:
    """Split decode's keys only when (sequences x KV heads) leaves the GPU idle, never below a few tiles each."""
    if programs >= TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), key_tiles // MIN_TILES_PER_SPLIT, 16))


def _launch(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_query: torch.Tensor,
    first_key_position: int,
    window: int | None,
    config: tuple[int, int, int],
    num_splits: int,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    require_triton(HAVE_TRITON)
    tokens, heads, head_dim = q.shape
    _, kv_heads, num_blocks, block_size, cache_dim = cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a pool of {kv_heads} KV heads of dimension {cache_dim}")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive or None, not {window}")
    group_pad, block_q, tile_k = config
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_splits > 1:
        part_out = torch.empty(tokens, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out, part_max, part_sum = out, out, out  # never read or written as partials
    d_pad = triton.next_power_of_2(head_dim)
    paged_attention_kernel[(tile_seq.shape[0], kv_heads, num_splits)](
        q, cache, block_tables, query_start, seq_lens, tile_seq, tile_query, part_out, part_max, part_sum,
        first_key_position, window or 0, head_dim**-0.5 if scale is None else scale, softcap or 0.0,
        block_tables.shape[1],
        kv_heads * num_blocks * block_size * head_dim, num_blocks * block_size * head_dim,
        NUM_HEADS=heads, HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=heads // kv_heads, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_SIZE=block_size, TILE_K=tile_k, NUM_SPLITS=num_splits,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits_kernel[(tokens * heads,)](
            part_out, part_max, part_sum, out,
            HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    first_key_position: int = 0,
    window: int | None = None,
    num_splits: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence, q: [B, heads, D], at position seq_lens - 1 -> [B, heads, D].

    Every launch shape depends only on B, the table width and ``num_splits``, never on the lengths, so a
    CUDA graph captured at one batch size replays for any lengths that fit the table.
    """
    batch, heads, head_dim = q.shape
    kv_heads = cache.shape[1]
    config = tile_config(head_dim, heads // kv_heads, is_decode=True)
    if num_splits is None:
        key_tiles = triton.cdiv(block_tables.shape[1] * cache.shape[3], config[2])
        num_splits = choose_num_splits(batch * kv_heads, key_tiles)
    rows = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return _launch(
        q, cache, block_tables, rows, seq_lens, rows[:-1], torch.zeros_like(rows[:-1]), first_key_position,
        window, config, num_splits, scale, softcap,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    first_key_position: int = 0,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A variable-length batch of new tokens, q: [T, heads, D], sequence s's in rows query_start[s]:[s+1],
    each the last tokens of its seq_lens[s] (its earlier tokens are a cached prefix in the pool) -> [T, heads, D]."""
    heads, head_dim = q.shape[1], q.shape[2]
    config = tile_config(head_dim, heads // cache.shape[1], is_decode=False)
    block_q = config[1]
    lengths = query_start.diff().tolist()  # tiles are laid out on the host: prefill is not graph-captured
    tile_seq = torch.tensor([s for s, n in enumerate(lengths) for _ in range(0, n, block_q)], dtype=torch.int32)
    tile_query = torch.tensor([i for n in lengths for i in range(0, n, block_q)], dtype=torch.int32)
    return _launch(
        q, cache, block_tables, query_start, seq_lens, tile_seq.to(q.device), tile_query.to(q.device),
        first_key_position, window, config, num_splits=1, scale=scale, softcap=softcap,
    )
