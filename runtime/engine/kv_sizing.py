"""How many KV blocks the pool gets, and the refusals of a pool too small to serve: sized from available memory on
the CPU, from what gpu_memory_utilization leaves after the weights and an activation reserve on CUDA."""

from __future__ import annotations

import os

import torch

from warmstart.runtime.engine.cuda_graphs import DEFAULT_BATCH_SIZES
from warmstart.runtime.engine.device import cuda_memory
from warmstart.runtime.engine.options import AUTO, EngineOptions
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.weights import DTYPES

# Kept beside the pool on CUDA for what the estimate of activation_reserve leaves out: cuBLAS workspaces, the
# caching allocator's rounding and fragmentation. An estimate, not a measurement: benchmarks/gpu_check.py
# records what a GPU really has left.
CUDA_WORKSPACE_BYTES = 256 << 20


def kv_blocks_for_memory(
    c: ModelConfig, o: EngineOptions, max_model_len: int, draft: ModelConfig | None = None, pinned_blocks: int = 0,
    device: torch.device | None = None,
) -> int:  # fmt: skip
    """How many KV blocks the pool gets when ``num_kv_blocks`` is not given, never more than ``max_num_seqs``
    full-length sequences could use beside the ``pinned_blocks``. On the CPU: a fraction of available memory.
    On CUDA (``device``, with the weights already on it): what ``gpu_memory_utilization`` of the GPU leaves after
    the weights and the activation reserve; a pool that cannot hold one ``max_model_len`` sequence beside the
    pinned blocks is refused, saying what to change."""
    block_bytes = kv_block_bytes(c, o, draft)
    useful = o.max_num_seqs * -(-max_model_len // o.block_size) + pinned_blocks  # more could never be used
    if device is None or device.type != "cuda":
        budget = int(available_memory() * o.kv_cache_memory_fraction)
        return max(1, min(budget // block_bytes, useful))
    memory = cuda_memory(device, o.gpu_memory_utilization, activation_reserve(c, o))
    blocks = memory.budget // block_bytes
    check_pool_fits_a_sequence(blocks, block_bytes, pinned_blocks, o, max_model_len, f"on {device}: {memory.explain()}")
    return min(blocks, useful)


def _element_size(o: EngineOptions) -> int:
    # "auto" not yet resolved (a size estimate before the engine exists): bfloat16's, what it resolves to wherever
    # the kernels have a vector path (runtime/engine/dtype_choice.py)
    return torch.empty((), dtype=DTYPES["bfloat16" if o.dtype == AUTO else o.dtype]).element_size()


def kv_block_bytes(c: ModelConfig, o: EngineOptions, draft: ModelConfig | None = None) -> int:
    elem = _element_size(o)
    block_bytes = 2 * c.num_layers * o.block_size * c.num_kv_heads * c.head_dim * elem
    if draft is not None:  # a block id holds KV in the draft's pool too
        block_bytes += 2 * draft.num_layers * o.block_size * draft.num_kv_heads * draft.head_dim * elem
    return block_bytes


def activation_reserve(c: ModelConfig, o: EngineOptions) -> int:
    """Bytes a step's activations may need at their peak on CUDA, kept out of the KV pool: one layer's
    tensors for a full step of ``max_num_batched_tokens`` (the residual stream, the normed input, QKV, the
    attention output, gate/up and its product), the logits of the rows a step samples (in the model's dtype
    and in float32), the same for the largest captured decode graph, and CUDA_WORKSPACE_BYTES."""
    elem = _element_size(o)
    per_token = 3 * c.hidden_size + 2 * c.q_size + 2 * c.kv_size + 3 * c.intermediate_size
    per_logits_row = c.vocab_size * (elem + 4)
    proposals = o.num_speculative_tokens if o.speculative else 0
    logits_rows = min(o.max_num_batched_tokens, o.max_num_seqs * (1 + proposals))
    graph_rows = max(DEFAULT_BATCH_SIZES)
    step = o.max_num_batched_tokens * per_token * elem + logits_rows * per_logits_row
    graphs = graph_rows * (per_token * elem + per_logits_row)
    return step + graphs + CUDA_WORKSPACE_BYTES


def check_pool_fits_a_sequence(
    blocks: int, block_bytes: int, pinned_blocks: int, o: EngineOptions, max_model_len: int, where: str
) -> None:
    """Refuse a pool sized from a GPU's memory that could not hold one full-length sequence beside the pinned
    blocks: every request would be refused or wait forever, so the server must not start."""
    per_sequence = -(-max_model_len // o.block_size)
    if blocks >= pinned_blocks + per_sequence:
        return
    fits = max(0, blocks - pinned_blocks) * o.block_size
    pinned = f" beside the {pinned_blocks} that snapshot prefixes and adapters pin" if pinned_blocks else ""
    shorter = f", lower max_model_len (serve --max-model-len) to at most {fits}" if fits else ""
    raise ValueError(
        f"the KV pool would get {blocks} blocks of {o.block_size} tokens ({block_bytes / (1 << 20):.2f} MiB each) "
        f"{where}; one {max_model_len}-token sequence needs {per_sequence} blocks{pinned}: raise "
        f"gpu_memory_utilization (serve --gpu-memory-utilization){shorter}, or free GPU memory"
    )


def check_pool_holds_pinned(num_blocks: int, pinned_blocks: int, o: EngineOptions, max_model_len: int) -> None:
    """Refuse, saying what to change, a pool that the pinned blocks would leave no room in for a request."""
    if num_blocks > pinned_blocks:
        return
    per_sequence = -(-max_model_len // o.block_size)
    if o.num_kv_blocks is None:
        fix = (f"free memory or raise kv_cache_memory_fraction (now {o.kv_cache_memory_fraction}), or set "
               f"num_kv_blocks (serve --num-kv-blocks) to {pinned_blocks + per_sequence}")
        pool = f"the pool sized from available memory has {num_blocks} blocks"
    else:
        fix = (f"raise num_kv_blocks (serve --num-kv-blocks) to at least {pinned_blocks + per_sequence} "
               f"({pinned_blocks} pinned plus {per_sequence} for one {max_model_len}-token sequence), or leave it "
               "unset to size the pool from memory")
        pool = f"num_kv_blocks is {num_blocks}"
    raise ValueError(f"snapshot prefixes and adapters pin {pinned_blocks} KV blocks and {pool}, which leaves no room "
                     f"for a request: {fix}")


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
