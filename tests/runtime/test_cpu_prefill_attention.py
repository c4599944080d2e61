"""Prefill attention's C kernel (runtime/kernels/cpu_attention.c, ``prefill``) against SDPA on gathered blocks."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from warmstart.runtime.kernels import isa as kernel_isa
from warmstart.runtime.layers import attention
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata, paged_attention, write_kv

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None
pytestmark = pytest.mark.skipif(NO_COMPILER and attention._cpu_attention is None, reason="no C compiler here")
LEVELS = kernel_isa.LEVELS
HAS_AVX512 = kernel_isa.at_least("avx512")


@pytest.fixture(params=kernel_isa.available())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each instruction set in use here (runtime/kernels/isa.py), the kernels lowered to it for the test."""
    with kernel_isa.lowered(request.param):
        yield request.param


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    groups: list[AttentionGroup]
    slots: torch.Tensor

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slots, groups=self.groups)


def make_case(
    heads: int, kv_heads: int, head_dim: int, block_size: int, chunks: list[tuple[int, int]], dtype: torch.dtype,
    window: int | None = None, seed: int = 0,
) -> Case:  # fmt: skip
    """Sequences whose blocks lie scattered in a pool of random KV; ``chunks``: (cached tokens, new tokens) per
    sequence, the new ones' KV written as the runner writes it. With a window the tables start at the first block
    a query can see, as the runner builds them."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-(cached + new) // block_size) for cached, new in chunks]
    num_blocks = sum(blocks) + 3
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    rows = sum(new for _, new in chunks)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    groups, slots, row, used = [], [], 0, 0
    for (cached, new), n in zip(chunks, blocks, strict=True):
        table = order[used : used + n]
        used += n
        positions = torch.arange(cached, cached + new)
        slots.append(table[positions // block_size] * block_size + positions % block_size)
        first = 0 if window is None else max(0, cached - window + 1) // block_size
        groups.append(AttentionGroup(
            rows=slice(row, row + new), block_tables=table[first:][None], query_positions=positions,
            first_key_position=first * block_size, is_decode=False, block_size=block_size,
        ))  # fmt: skip
        row += new
    write_kv(cache, k, v, torch.cat(slots))
    return Case(q, k, v, cache, groups, torch.cat(slots))


def both_paths(case: Case, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    reference = paged_attention(case.q, case.k, case.v, case.cache, case.meta(), window, decode_kernel=False)
    got = paged_attention(case.q, case.k, case.v, case.cache, case.meta(), window, decode_kernel=True,
                          prefill_kernel=True)  # fmt: skip
    return got, reference


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    else:  # both round to bfloat16 (SDPA its probabilities too); the kernel sums in float32
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
        assert (got.float() - want.float()).abs().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 80, 32), (8, 2, 128, 24), (7, 1, 64, 32), (6, 2, 40, 16), (3, 1, 36, 16)],
)
def test_kernel_matches_sdpa(
    isa: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Fresh chunks and chunks behind cached prefixes ending mid-block, several sequences in one call; GQA groups
    1, 3, 4 and 7; head_dim 40 takes the AVX2 code at AVX-512 too, 36 the portable code at every level."""
    chunks = [(0, 70), (37, 50), (block_size, 3), (5, 1 + block_size), (0, 2)]
    got, want = both_paths(make_case(heads, kv_heads, head_dim, block_size, chunks, dtype), None)
    assert_matches(got, want)


@pytest.mark.parametrize("window", [1, 7, 40, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_sliding_window_matches(isa: str, window: int, dtype: torch.dtype) -> None:
    """Windows shorter and longer than the chunk, with and without a cached prefix before it."""
    case = make_case(9, 3, 64, 16, [(0, 60), (45, 40), (100, 20)], dtype, window=window, seed=1)
    got, want = both_paths(case, window)
    assert_matches(got, want)


@pytest.mark.parametrize("window", [None, 33, 64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_long_chunks_match(isa: str, window: int | None, dtype: torch.dtype) -> None:
    """Chunks long enough that most key tiles lie wholly inside every row's causal range and window (the kernel
    skips the masks there) and some straddle a window's lower edge."""
    case = make_case(9, 3, 64, 16, [(0, 300), (200, 130), (17, 260)], dtype, window=window, seed=2)
    got, want = both_paths(case, window)
    assert_matches(got, want)


# bf16 dot products (avx512_bf16) round the probabilities: not the float32 computation
@pytest.mark.parametrize("level", [level for level in kernel_isa.available() if level != "avx512_bf16"])
def test_bf16_output_rounds_as_torch(level: str) -> None:
    """Without bf16 dot products a bf16 pool is computed exactly as its float32 copy would be, so the kernel's bf16
    output must be that float32 output rounded as torch rounds it (to nearest even), bit for bit."""
    with kernel_isa.lowered(level):
        _bf16_output_rounds_as_torch()


def _bf16_output_rounds_as_torch() -> None:
    case = make_case(9, 3, 64, 16, [(0, 40), (21, 30)], torch.bfloat16, seed=7)
    wide = Case(case.q.float(), case.k.float(), case.v.float(), case.cache.float(), case.groups, case.slots)
    got, _ = both_paths(case, None)
    as_float, _ = both_paths(wide, None)
    assert torch.equal(got, as_float.to(torch.bfloat16))


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_computes_the_avx512_float32_floats(window: int | None, dtype: torch.dtype) -> None:
    """The AVX2 code takes each row's sums in the AVX-512 float32 code's order, with an exp that agrees to the bit
    (vec256.h's exp8): the same output, bit for bit, for every row count a work item can have (groups 1 and 3).
    Without AVX-512 the AVX2 code (or, without AVX2, the portable code) is held to the PyTorch path instead."""
    narrow_level = "avx2" if kernel_isa.at_least("avx2") else "portable"
    for heads, kv_heads in ((3, 3), (9, 3)):
        case = make_case(heads, kv_heads, 64, 16, [(0, 130), (37, 50), (5, 1), (0, 9), (20, 64)], dtype, window, seed=8)
        with kernel_isa.lowered(narrow_level):
            narrow, reference = both_paths(case, window)
        if HAS_AVX512:
            with kernel_isa.lowered("avx512"):
                wide, _ = both_paths(case, window)
            assert torch.equal(narrow, wide)
        else:
            assert_matches(narrow, reference)


def test_kernel_leaves_decode_groups_to_the_decode_path() -> None:
    """A step with decode rows between prefill chunks: each row gets its own path's answer."""
    case = make_case(9, 3, 64, 16, [(0, 30), (20, 9)], torch.float32, seed=2)
    decode = AttentionGroup(
        rows=torch.tensor([30]), block_tables=case.groups[0].block_tables, query_positions=torch.tensor([29]),
        first_key_position=0, is_decode=True, block_size=16,
    )  # fmt: skip
    q, k, v = (torch.cat([x[:30], x[29:30] * 2, x[30:]]) for x in (case.q, case.k, case.v))
    later = case.groups[1]
    shifted = AttentionGroup(rows=slice(31, 40), block_tables=later.block_tables, query_positions=later.query_positions,
                             first_key_position=0, is_decode=False, block_size=16)  # fmt: skip
    meta = AttentionMetadata(slot_mapping=case.slots, groups=[case.groups[0], decode, shifted])
    want = paged_attention(q, k, v, case.cache, meta, None, decode_kernel=False)
    meta = AttentionMetadata(slot_mapping=case.slots, groups=[case.groups[0], decode, shifted])
    got = paged_attention(q, k, v, case.cache, meta, None, decode_kernel=True, prefill_kernel=True)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_kernel_reads_queries_from_a_strided_view() -> None:
    """The model's q is a view of the qkv output (rows wider than heads * head_dim): read in place."""
    case = make_case(4, 2, 64, 16, [(10, 25)], torch.bfloat16, seed=3)
    wide = torch.cat([case.q.view(25, -1), torch.full((25, 64), float("nan"), dtype=torch.bfloat16)], dim=1)
    view = wide[:, : 4 * 64].view(25, 4, 64)
    assert not view.is_contiguous()
    strided = Case(view, case.k, case.v, case.cache, case.groups, case.slots)
    got, _ = both_paths(strided, None)
    contiguous, _ = both_paths(case, None)
    assert torch.equal(got, contiguous)


def test_kernel_reads_no_key_past_the_chunk(isa: str) -> None:
    """Pool rows after a chunk's last key (NaN here) and padding in the tables never reach the output."""
    case = make_case(6, 2, 64, 16, [(3, 10)], torch.float32, seed=4)
    clean, _ = both_paths(case, None)
    block = case.groups[0].block_tables[0, 0]
    case.cache[:, :, block, 13:] = float("nan")
    case.groups[0].block_tables = torch.cat([case.groups[0].block_tables, torch.tensor([[0]])], dim=1)
    got, _ = both_paths(case, None)
    assert torch.equal(got, clean)


def test_kernel_threads_do_not_change_results() -> None:
    case = make_case(9, 3, 64, 16, [(0, 200), (100, 77), (0, 5)], torch.bfloat16, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = both_paths(case, None)
        torch.set_num_threads(2)
        two, _ = both_paths(case, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_kernel_refuses_what_does_not_fit() -> None:
    kernel = attention._cpu_attention
    assert kernel is not None
    with pytest.raises(ValueError, match="query heads per KV head"):
        kernel.prefill(0, 0, 0, 0, 0, 0, 0, 34, 2, 64, 16, 1, 1024, 2176, 2176, 0, 0.125, 0, 1)
    tables, seqs = torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[0, 40, 0, 0]])
    with pytest.raises(ValueError, match="does not fit its block table of 2 columns of 16"):
        kernel.prefill(0, 0, 0, 0, tables.data_ptr(), seqs.data_ptr(), 1, 4, 2, 64, 16, 2, 1024, 256, 256, 0, 0.125,
                       0, 1)  # fmt: skip
    with pytest.raises(ValueError, match="is not an instruction set this CPU has"):
        kernel.isa("avx1024")


def test_when_the_prefill_kernel_serves(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wherever its vector code runs, AVX2 or better (head_dim a multiple of 8, of 16 for AVX-512's), at the level
    the kernels use: never on the portable loop, which is slower than SDPA."""
    vectorized = isa != "portable"
    assert attention.prefill_kernel_chosen(64) == vectorized
    assert attention.prefill_kernel_chosen(40) == vectorized
    assert not attention.prefill_kernel_chosen(36)
    monkeypatch.setenv("WARMSTART_CPU_PREFILL_ATTENTION", "torch")
    assert not attention.prefill_kernel_chosen(64)
    monkeypatch.setenv("WARMSTART_CPU_PREFILL_ATTENTION", "fast")
    with pytest.raises(ValueError, match="WARMSTART_CPU_PREFILL_ATTENTION='fast' is not one of kernel, torch"):
        attention.prefill_kernel_chosen(64)


def test_engine_prefills_on_the_kernel(isa: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The engine's CPU path prefills on the kernel at AVX2 and above (head_dim 16), a step's chunks in one call,
    cached prefixes and chunked prompts included, and on SDPA at the portable level; SDPA
    (``WARMSTART_CPU_PREFILL_ATTENTION=torch``) gives the same greedy tokens."""
    from warmstart.runtime import LLM, SamplingParams

    calls: list[int] = []
    kernel = attention._kernel_prefill_attention

    def counting(out, q, cache, tables, seqs, window, scale):  # type: ignore[no-untyped-def]
        calls.append(seqs.shape[0])
        return kernel(out, q, cache, tables, seqs, window, scale)

    monkeypatch.setattr(attention, "_kernel_prefill_attention", counting)
    model_dir = tiny_model_dir("qwen2")
    shared = [7, 8, 9] * 9
    prompts = [shared + [5 + i] * (3 + 7 * i) for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM.from_hf(model_dir, dtype="bfloat16", block_size=8, num_kv_blocks=64, max_num_batched_tokens=40)
        llm.generate(prompts[:1], params)  # the shared prefix cached
        return [o.token_ids for o in llm.generate(prompts, params)]

    with_kernel = run()
    if isa == "portable":
        assert not calls
    else:
        assert calls and max(calls) > 1
    monkeypatch.setenv("WARMSTART_CPU_PREFILL_ATTENTION", "torch")
    calls.clear()
    with_sdpa = run()
    assert not calls
    assert with_kernel == with_sdpa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 700])
def test_write_kv_kernel_equals_index_copy(dtype: torch.dtype, tokens: int) -> None:
    """k and v as views of one qkv row each (as the model passes them), slots scattered over the pool."""
    gen = torch.Generator().manual_seed(6)
    kv_heads, head_dim, num_blocks, block_size = 3, 64, 60, 16
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    _, k, v = qkv.split([9 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    want = cache.clone()
    attention.write_kv_torch(want, k, v, slots)
    write_kv(cache, k, v, slots)
    assert torch.equal(cache, want)


def test_write_kv_refuses_a_slot_outside_the_pool() -> None:
    cache = torch.zeros(2, 1, 4, 8, 16)
    k = torch.ones(2, 1, 16)
    with pytest.raises(ValueError, match="slot 32 of token 1 is outside the pool's 32 slots"):
        write_kv(cache, k, k, torch.tensor([0, 32]))
    assert not cache.any()
