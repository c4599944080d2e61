"""Paged attention (decode, split-K decode, prefill over a cached prefix), the KV write, rotary and QK norm
kernels against their references, over head_dim 64 / 80 / 128, GQA ratios 1 / 4 / 7, block sizes 16 / 32,
lengths that end inside a block and windows shorter than the sequence. Each value of each axis is covered;
the full cross product would cost the interpreter minutes."""

from __future__ import annotations

import pytest
import torch

from tests.support.kernels_common import DEVICE, EPS, assert_close, randn  # sets TRITON_INTERPRET first

pytestmark = pytest.mark.kernels

from warmstart.runtime.kernels.kv_cache import write_kv, write_kv_reference  # noqa: E402
from warmstart.runtime.kernels.paged_attention import (  # noqa: E402
    paged_attention_reference,
    paged_decode_attention,
    paged_prefill_attention,
)
from warmstart.runtime.kernels.rmsnorm import rms_norm  # noqa: E402
from warmstart.runtime.kernels.rotary import rotary_  # noqa: E402
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata, paged_attention  # noqa: E402
from warmstart.runtime.layers.norm import rms_norm as rms_norm_reference  # noqa: E402
from warmstart.runtime.layers.rotary import RotaryTables, apply_rotary, lookup  # noqa: E402
from warmstart.runtime.models.config import ModelConfig, rope_inv_freq  # noqa: E402

NUM_BLOCKS = 24


def pool(kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return randn(2, kv_heads, NUM_BLOCKS, block_size, head_dim, dtype=dtype, seed=seed)


def block_tables(seq_lens: list[int], block_size: int, seed: int) -> torch.Tensor:
    """Each sequence's blocks drawn from a shuffled pool, padded with block 0 to one width."""
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(order[:need] + [0] * (width - need))
        order = order[need:]
    return torch.tensor(tables, dtype=torch.int32, device=DEVICE)


def ints(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=DEVICE)


# (head_dim, GQA ratio, kv_heads, block_size, window, num_splits): every value of each axis at least once.
DECODE_CASES = [
    (64, 1, 2, 16, None, 1),
    (80, 4, 1, 32, None, 3),
    (128, 7, 1, 16, 20, 1),
    (64, 7, 1, 32, 33, 2),
    (80, 1, 3, 16, 9, 4),
    (128, 4, 2, 32, None, None),  # the split count the launcher picks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("head_dim", "ratio", "kv_heads", "block_size", "window", "num_splits"), DECODE_CASES)
def test_decode_attention_matches_reference(
    head_dim: int, ratio: int, kv_heads: int, block_size: int, window: int | None, num_splits: int | None,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    seq_lens = [1, 17, 70, 45]  # ending inside blocks of 16 and of 32
    cache = pool(kv_heads, block_size, head_dim, dtype, seed=head_dim)
    tables = block_tables(seq_lens, block_size, seed=ratio)
    q = randn(len(seq_lens), kv_heads * ratio, head_dim, dtype=dtype, seed=7)
    lens = ints(seq_lens)
    out = paged_decode_attention(q, cache, tables, lens, window=window, num_splits=num_splits)
    expected = paged_attention_reference(q, cache, tables, ints(list(range(len(seq_lens) + 1))), lens, 0, window)
    assert_close(out, expected)


# (head_dim, GQA ratio, block_size, window): queries are the last tokens of each sequence, after a cached prefix.
PREFILL_CASES = [(64, 4, 16, None), (80, 7, 32, None), (128, 1, 16, 11), (64, 1, 32, 40), (80, 4, 16, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("head_dim", "ratio", "block_size", "window"), PREFILL_CASES)
def test_prefill_attention_matches_reference(
    head_dim: int, ratio: int, block_size: int, window: int | None, dtype: torch.dtype
) -> None:
    prefix_and_new = [(0, 19), (13, 9), (40, 1), (0, 1), (33, 30)]  # a whole prompt, chunks, one token
    seq_lens = [p + n for p, n in prefix_and_new]
    query_start = ints([0, *torch.tensor([n for _, n in prefix_and_new]).cumsum(0).tolist()])
    kv_heads = 2 if ratio < 7 else 1
    cache = pool(kv_heads, block_size, head_dim, dtype, seed=head_dim + 1)
    tables = block_tables(seq_lens, block_size, seed=ratio + 1)
    q = randn(int(query_start[-1]), kv_heads * ratio, head_dim, dtype=dtype, seed=8)
    lens = ints(seq_lens)
    out = paged_prefill_attention(q, cache, tables, query_start, lens, window=window)
    assert_close(out, paged_attention_reference(q, cache, tables, query_start, lens, 0, window))


def test_tables_starting_past_the_first_block_under_a_window() -> None:
    """The engine drops blocks wholly outside the window: the table's first column is then a later block."""
    block_size, window, first = 16, 20, 32  # positions 0..31 are outside every query's window
    seq_lens = [60, 55]
    cache = pool(2, block_size, 64, torch.float32, seed=3)
    tables = block_tables([n - first for n in seq_lens], block_size, seed=3)
    q = randn(2, 8, 64, dtype=torch.float32, seed=9)
    expected = paged_attention_reference(q, cache, tables, ints([0, 1, 2]), ints(seq_lens), first, window)
    for splits in (1, 2):
        out = paged_decode_attention(q, cache, tables, ints(seq_lens), first, window, num_splits=splits)
        assert_close(out, expected)
    new = 5
    q_new = randn(new, 8, 64, dtype=torch.float32, seed=10)
    args = (q_new, cache, tables[:1], ints([0, new]), ints(seq_lens[:1]), first, window)
    assert_close(paged_prefill_attention(*args), paged_attention_reference(*args))


@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prefill"])
def test_reference_is_the_engines_attention(is_decode: bool) -> None:
    """The kernels' reference computes what the engine's PyTorch path computes: matching it is matching the engine."""
    block_size, head_dim, kv_heads, heads, window = 16, 64, 2, 8, 23
    seq_lens = [40] if not is_decode else [40, 7, 33]
    new = 1 if is_decode else 12
    # On the CPU, where the engine's PyTorch path runs.
    cache = pool(kv_heads, block_size, head_dim, torch.float32, seed=11).cpu()
    tables = block_tables(seq_lens, block_size, seed=11).long().cpu()
    rows = len(seq_lens) * new
    q = randn(rows, heads, head_dim, dtype=torch.float32, seed=12).cpu()
    positions = torch.tensor([n - 1 for n in seq_lens]) if is_decode else torch.arange(seq_lens[0] - new, seq_lens[0])
    rows_of = torch.arange(rows) if is_decode else slice(0, rows)
    group = AttentionGroup(rows_of, tables, positions, 0, is_decode, block_size)
    meta = AttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.long), groups=[group])
    unused = torch.empty(rows, kv_heads, head_dim)  # only a first chunk's own keys are read from k_new/v_new
    engine = paged_attention(q, unused, unused, cache, meta, window).view(rows, heads, head_dim)
    query_start = torch.tensor(list(range(rows + 1)) if is_decode else [0, rows])
    assert_close(paged_attention_reference(q, cache, tables, query_start, torch.tensor(seq_lens), 0, window), engine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("head_dim", "kv_heads", "block_size"), [(64, 1, 16), (80, 2, 32), (128, 3, 16)])
def test_write_kv_matches_reference(head_dim: int, kv_heads: int, block_size: int, dtype: torch.dtype) -> None:
    n = 11
    cache = pool(kv_heads, block_size, head_dim, dtype, seed=13)
    expected = cache.clone()
    # k and v as the model has them: strided views into one fused projection.
    qkv = randn(n, (kv_heads * 3) * head_dim, dtype=dtype, seed=14)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(n, kv_heads, head_dim)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=torch.Generator().manual_seed(n))[:n].to(DEVICE)
    write_kv(cache, k, v, slots)
    write_kv_reference(expected, k, v, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads", "rope_scaling"),
    [
        (64, 4, 4, None),
        (80, 7, 1, None),
        (128, 8, 2, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}),  # fmt: skip
    ],
)
def test_rotary_in_place_matches_reference(
    head_dim: int, heads: int, kv_heads: int, rope_scaling: dict | None, dtype: torch.dtype
) -> None:
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": heads * head_dim,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": 32, "rope_theta": 500000.0,
        "rope_scaling": rope_scaling, "rms_norm_eps": EPS, "max_position_embeddings": 256,
    })  # fmt: skip
    tables = RotaryTables(*rope_inv_freq(config), 256, dtype)
    n = 9
    qkv = randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=head_dim) * 2
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 5, 17, 63, 64, 100, 200, 255], device=DEVICE)
    cos, sin = tables.cos.to(DEVICE), tables.sin.to(DEVICE)
    expected_q, expected_k = apply_rotary(q, k, *lookup(cos, sin, positions))
    rotary_(q, k, cos, sin, positions)
    # Products are rounded before the sum: when the sum cancels, one bfloat16 ulp of a product (truncated
    # under the interpreter) is large next to the result, so the absolute tolerance is two ulps of the inputs.
    tolerance = (2.0**-6 * float(qkv.abs().max()), 2e-2) if dtype == torch.bfloat16 else None
    assert_close(q, expected_q, tolerance)
    assert_close(k, expected_k, tolerance)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_qk_norm_normalizes_each_head(head_dim: int) -> None:
    """Qwen3's QK norm is rms_norm over [N, heads, head_dim] with one weight per head dimension."""
    x = randn(6, 7, head_dim, dtype=torch.bfloat16, seed=head_dim) * 3
    weight = randn(head_dim, dtype=torch.bfloat16, seed=15)
    assert_close(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))
