"""Embeddings, as vLLM's pooling runner makes them from a decoder model: each prompt's final hidden states
(after the final norm) pooled to one vector, its last token's ("last", vLLM's default for decoder models) or
the mean over its tokens ("mean"), then L2-normalized.

Computed on the step loop's thread between steps, in KV blocks borrowed from the free pool and given back at
once: nothing is cached and no request is scheduled. Prompts go through in passes of at most
``max_num_batched_tokens`` tokens (one prompt longer than that still goes alone)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F

from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.input_processor import Prompt
from warmstart.runtime.engine.model_runner import Chunk
from warmstart.runtime.engine.sequence import Sequence
from warmstart.runtime.sampling_params import SamplingParams

POOLING = ("last", "mean")


class PoolBusy(Exception):
    """The KV pool has no room for a prompt's blocks now (running requests hold them): retry later."""


def embed(engine: LLMEngine, prompts: Seq[Prompt], pooling: str = "last", normalize: bool = True) -> list[torch.Tensor]:
    """One float32 vector [hidden_size] per prompt, on the CPU; raises ValueError naming a bad prompt or option
    (before anything runs) and PoolBusy when the pool cannot hold a prompt's blocks now."""
    if pooling not in POOLING:
        raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {pooling!r}")
    if engine.runner.model.sharded:
        raise ValueError("embeddings are not served with tensor parallelism yet; serve on one device")
    if not prompts:
        raise ValueError("no prompts to embed")
    token_lists = [engine.inputs.prompt_token_ids(p) for p in prompts]
    for i, ids in enumerate(token_lists):
        if len(ids) > engine.max_model_len:
            raise ValueError(f"prompt {i} is {len(ids)} tokens, more than the context of {engine.max_model_len}")
    vectors: list[torch.Tensor] = []
    budget = engine.options.max_num_batched_tokens
    start = 0
    while start < len(token_lists):
        end, tokens = start + 1, len(token_lists[start])
        while end < len(token_lists) and tokens + len(token_lists[end]) <= budget:
            tokens += len(token_lists[end])
            end += 1
        vectors += _pass(engine, token_lists[start:end], pooling)
        start = end
    return [F.normalize(v, dim=-1) if normalize else v for v in vectors]


def _pass(engine: LLMEngine, token_lists: list[list[int]], pooling: str) -> list[torch.Tensor]:
    """One forward over prompts that fit one pass: their rows' hidden states, pooled."""
    bs, blocks = engine.blocks.block_size, engine.blocks
    needed = sum(-(-len(ids) // bs) for ids in token_lists)
    if needed > blocks.num_free_blocks:
        raise PoolBusy(f"embedding {sum(map(len, token_lists))} tokens needs {needed} KV blocks and "
                       f"{blocks.num_free_blocks} are free now; retry when running requests finish")
    holders = [Sequence(f"embedding-{i}", [], 0, SamplingParams(max_tokens=1)) for i in range(len(token_lists))]
    try:
        for holder, ids in zip(holders, token_lists, strict=True):
            holder.block_table = blocks.take_free(-(-len(ids) // bs))
        rows = 1 if pooling == "last" else None
        chunks = [Chunk(h.block_table, ids, 0, rows or len(ids)) for h, ids in zip(holders, token_lists, strict=True)]
        hidden = engine.runner.forward(chunks, hidden=True).cpu()
    finally:
        for holder in holders:
            blocks.free_seq(holder)
    if pooling == "last":
        return list(hidden)
    sizes = [len(ids) for ids in token_lists]
    return [part.mean(dim=0) for part in hidden.split(sizes)]
