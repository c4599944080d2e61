"""The last decoder layer carries on past its KV write with only the rows whose logits a step wants
(runtime/models/model.py): the same logits and the same pool as computing every row, less work."""

from __future__ import annotations

import pytest
import torch

from warmstart.runtime import LLM
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata
from warmstart.runtime.models.model import Model


def prefill_step(model: Model, lengths: list[int], block_size: int = 16) -> tuple:  # type: ignore[type-arg]
    """Fresh prompts of ``lengths`` tokens, each over its own blocks of a zeroed pool, as one prefill step."""
    c = model.config
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, c.vocab_size, (sum(lengths),), generator=gen)
    groups, slots, positions, row, block = [], [], [], 0, 0
    for n in lengths:
        blocks = -(-n // block_size)
        table = torch.arange(block, block + blocks)
        pos = torch.arange(n)
        groups.append(AttentionGroup(slice(row, row + n), table[None], pos, 0, is_decode=False, block_size=block_size))
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        positions.append(pos)
        row, block = row + n, block + blocks
    caches = [torch.zeros(2, c.num_kv_heads, block, block_size, c.head_dim, dtype=model.dtype)
              for _ in range(c.num_layers)]  # fmt: skip
    return tokens, torch.cat(positions), caches, AttentionMetadata(torch.cat(slots), groups)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_wanted_rows_only_give_the_same_logits_and_pool(family: str, dtype: str, tiny_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each prompt's last row (and a chunk that wants none) against the same step with every row's logits: equal
    logits for the wanted rows, an equal pool; the last layer's MLP sees the wanted rows only."""
    engine = LLM.from_hf(tiny_model_dir(family), dtype=dtype).engine
    if engine.prepack_thread is not None:  # both forwards on the same weights: packed ones, where they pack
        engine.prepack_thread.join()
    model = engine.runner.model
    lengths = [37, 20, 5]
    tokens, positions, caches, meta = prefill_step(model, lengths)
    every = torch.arange(sum(lengths))
    reference_caches = [cache.clone() for cache in caches]
    reference = model.forward(tokens, positions, reference_caches, meta, every)

    mlp_rows: list[int] = []
    silu_and_mul = model.ops.silu_and_mul
    monkeypatch.setattr(model.ops, "silu_and_mul", lambda x: mlp_rows.append(x.shape[0]) or silu_and_mul(x))
    wanted = torch.tensor([36, 56, 61])
    ours = model.forward(tokens, positions, caches, meta, wanted)
    assert mlp_rows == [sum(lengths)] * (model.config.num_layers - 1) + [3]
    if dtype == "float32":
        torch.testing.assert_close(ours, reference[wanted], rtol=1e-5, atol=1e-5)
    else:  # another row count may take another GEMM blocking: sums in another order
        torch.testing.assert_close(ours, reference[wanted], rtol=0, atol=0.02 * float(reference.abs().max()))
    for cache, reference_cache in zip(caches, reference_caches, strict=True):
        assert torch.equal(cache, reference_cache)

    mlp_rows.clear()
    none = model.forward(tokens, positions, [cache.clone() for cache in caches], meta, every[:0])
    assert none.shape == (0, reference.shape[1]) and mlp_rows[-1] == 0
