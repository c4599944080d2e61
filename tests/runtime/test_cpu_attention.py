"""Decode attention's C kernel (runtime/kernels/cpu_attention.c) against the gather-and-matmul path it replaces."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

from warmstart.runtime.kernels import isa as kernel_isa
from warmstart.runtime.layers import attention
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata, decode_kernel_serves, paged_attention

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None
pytestmark = pytest.mark.skipif(NO_COMPILER and attention._cpu_attention is None, reason="no C compiler here")
LEVELS = kernel_isa.LEVELS


@pytest.fixture(params=kernel_isa.available())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each instruction set in use here (runtime/kernels/isa.py), the kernels lowered to it for the test."""
    with kernel_isa.lowered(request.param):
        yield request.param


def test_the_kernel_was_built() -> None:
    """Where a C compiler exists the install must have built the kernel: a silent fallback would hide it."""
    assert attention._cpu_attention is not None, "the C kernel is missing: reinstall (pip install -e .)"


def make_case(
    seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int, lengths: list[int], dtype: torch.dtype,
    first_block: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionGroup]:  # fmt: skip
    """A pool with each sequence's blocks scattered at random, queries at each sequence's last position; the
    group's tables start at ``first_block`` (as for a sliding window)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + 3
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks:
        tables.append(order[used : used + n][first_block:])
        used += n
    width = max(1, max(len(t) for t in tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    group = AttentionGroup(
        rows=torch.arange(len(lengths)), block_tables=table, query_positions=torch.tensor([n - 1 for n in lengths]),
        first_key_position=first_block * block_size, is_decode=True, block_size=block_size,
    )  # fmt: skip
    return q, cache, group


def both_paths(q: torch.Tensor, cache: torch.Tensor, group: AttentionGroup, window: int | None):  # type: ignore[no-untyped-def]
    meta = AttentionMetadata(slot_mapping=torch.zeros(q.shape[0], dtype=torch.long), groups=[group])
    reference = paged_attention(q, q, q, cache, meta, window, decode_kernel=False)
    return paged_attention(q, q, q, cache, meta, window, decode_kernel=True), reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# head_dim a multiple of 16 takes the AVX-512 code at that level, 24 and 40 the AVX2 code there, 36 the portable
# code at every level.
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 4, 32), (9, 3, 64), (8, 1, 80), (16, 2, 128), (6, 2, 40), (2, 1, 24), (3, 1, 36)],
)
@pytest.mark.parametrize("block_size", [8, 12, 16])  # 12: tiles of keys cut short by each block's end
def test_kernel_matches_gather_path(
    isa: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    lengths = [1, 2, block_size, block_size + 1, 37, 200, 5, 64]
    q, cache, group = make_case(0, heads, kv_heads, head_dim, block_size, lengths, dtype)
    got, want = both_paths(q, cache, group, None)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    else:  # the gather path rounds scores and probabilities to bfloat16 in its matmuls; the kernel keeps float32
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
        assert (got.float() - want.float()).abs().mean() < 2e-3


@pytest.mark.parametrize("window", [1, 5, 16, 33])
@pytest.mark.parametrize("first_block", [0, 2])
def test_kernel_sliding_window_matches(isa: str, window: int, first_block: int) -> None:
    lengths = [70, 90, 41, 100]  # all past the group's first block
    q, cache, group = make_case(1, 8, 2, 64, 8, lengths, torch.float32, first_block=first_block)
    if first_block:  # a window that reaches before the tables' first key is not what the runner builds
        window = min(window, min(lengths) - first_block * 8)
    got, want = both_paths(q, cache, group, window)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_kernel_attends_only_its_keys(isa: str) -> None:
    """Keys past a sequence's end (garbage, even NaN) and padding in the tables never reach the output."""
    q, cache, group = make_case(2, 4, 2, 32, 8, [3, 20], torch.float32)
    clean, _ = both_paths(q, cache.clone(), group, None)
    dirty = cache.clone()
    last = group.block_tables[0, 0]  # the first sequence's only block: offsets 3.. are past its end
    dirty[:, :, last, 3:] = float("nan")
    got, _ = both_paths(q, dirty, group, None)
    assert torch.equal(got, clean)


def test_kernel_threads_do_not_change_results(isa: str) -> None:
    q, cache, group = make_case(3, 9, 3, 64, 16, [500, 3, 77, 1000, 16, 17], torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = both_paths(q, cache, group, None)
        torch.set_num_threads(2)
        two, _ = both_paths(q, cache, group, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_kernel_refuses_unsupported_shapes() -> None:
    assert attention._cpu_attention is not None
    with pytest.raises(ValueError, match="query heads per KV head"):
        attention._cpu_attention.decode(0, 0, 0, 0, 0, 0, 0, 1, 34, 2, 64, 16, 1, 1024, 0.125, 0, 1)


def test_when_the_kernel_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert decode_kernel_serves(cpu, torch.bfloat16, 3, 64)
    assert decode_kernel_serves(cpu, torch.float32, 16, 512)
    assert not decode_kernel_serves(cpu, torch.float16, 3, 64)
    assert not decode_kernel_serves(cpu, torch.float32, 17, 64)
    assert not decode_kernel_serves(cpu, torch.float32, 1, 1024)
    assert not decode_kernel_serves(torch.device("meta"), torch.float32, 1, 64)
    monkeypatch.setenv("WARMSTART_CPU_ATTENTION", "torch")
    assert not decode_kernel_serves(cpu, torch.float32, 3, 64)
    monkeypatch.setenv("WARMSTART_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="WARMSTART_CPU_ATTENTION='fast' is not one of kernel, torch"):
        decode_kernel_serves(cpu, torch.float32, 3, 64)


def test_engine_uses_the_kernel_and_one_decode_group(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The engine's CPU path decodes on the kernel, all decoding sequences in one call; the gather path
    (``WARMSTART_CPU_ATTENTION=torch``) gives the same greedy tokens."""
    from warmstart.runtime import LLM, SamplingParams

    calls: list[int] = []
    kernel = attention._kernel_decode_attention

    def counting(q, cache, g, window, scale):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        return kernel(q, cache, g, window, scale)

    monkeypatch.setattr(attention, "_kernel_decode_attention", counting)
    # the ordinary ops' attention: decode steps of up to 8 rows otherwise run whole in cpu_gemv.c (test_fused_decode.py)
    monkeypatch.setenv("WARMSTART_CPU_FUSED_DECODE", "torch")
    model_dir = tiny_model_dir("qwen2")
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM.from_hf(model_dir, block_size=8, num_kv_blocks=64)
    with_kernel = [o.token_ids for o in llm.generate(prompts, params)]
    assert max(calls) == len(prompts)
    monkeypatch.setenv("WARMSTART_CPU_ATTENTION", "torch")
    calls.clear()
    gathered = [o.token_ids for o in LLM.from_hf(model_dir, block_size=8, num_kv_blocks=64).generate(prompts, params)]
    assert not calls
    assert with_kernel == gathered
