"""First call (compile) and second call of every Triton kernel at a model's shapes, timed, one by one.

A measurement, not a warm-up: the engine warms its kernels up with ModelRunner.warm_up_kernels (one prefill and one
decode step, before serving). A kernel's first call compiles it (or loads it from Triton's cache, see
runtime.kernels.carried_cache_dir); timing each says what a cold start without that cache pays, and where.
benchmarks/gpu_check.py's first_call section runs this in fresh processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from warmstart.runtime.kernels.activation import silu_and_mul
from warmstart.runtime.kernels.kv_cache import write_kv
from warmstart.runtime.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from warmstart.runtime.kernels.quant_matmul import quantized_linear
from warmstart.runtime.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from warmstart.runtime.kernels.rotary import rotary_
from warmstart.runtime.layers.rotary import RotaryTables
from warmstart.runtime.models.config import ModelConfig, rope_inv_freq
from warmstart.runtime.quant.formats import Int8Weight


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def kernel_calls(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int = 16
) -> dict[str, Callable[[], object]]:
    """One call of each kernel the engine uses, at the model's head and hidden sizes and a small batch."""
    c = config
    n, blocks, eps = 8, 8, c.rms_norm_eps

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype)

    x, weight = rand(n, c.hidden_size), rand(c.hidden_size)
    q, k, v = rand(n, c.num_heads, c.head_dim), rand(n, c.num_kv_heads, c.head_dim), rand(n, c.num_kv_heads, c.head_dim)
    cache = torch.zeros(2, c.num_kv_heads, blocks * 2, block_size, c.head_dim, dtype=dtype, device=device)
    tables = torch.arange(blocks * 2, dtype=torch.int32, device=device).view(2, blocks)
    rotary = RotaryTables(*rope_inv_freq(c), 64, dtype)
    cos, sin = rotary.cos.to(device), rotary.sin.to(device)
    positions = torch.arange(n, device=device)
    lens = torch.tensor([block_size * blocks - 3, 5], dtype=torch.int32, device=device)
    int8 = Int8Weight.quantize(torch.randn(c.hidden_size, c.hidden_size).to(dtype))
    int8 = Int8Weight(int8.qweight.to(device), int8.scales.to(device))
    calls: dict[str, Callable[[], object]] = {
        "rms_norm": lambda: rms_norm(x, weight, eps),
        "fused_add_rms_norm": lambda: fused_add_rms_norm(x, x, weight, eps),
        "qk_norm": lambda: rms_norm(q, rand(c.head_dim), eps),
        "silu_and_mul": lambda: silu_and_mul(rand(n, 2 * c.intermediate_size)),
        "rotary": lambda: rotary_(q, k, cos, sin, positions),
        "write_kv": lambda: write_kv(cache, k, v, positions),
        "decode_attention": lambda: paged_decode_attention(q[:2], cache, tables, lens, num_splits=1),
        "decode_attention_split": lambda: paged_decode_attention(q[:2], cache, tables, lens, num_splits=4),
        "prefill_attention": lambda: paged_prefill_attention(
            q, cache, tables, torch.tensor([0, 3, n], dtype=torch.int32, device=device), lens
        ),
        "int8_matmul": lambda: quantized_linear(x, int8),
    }
    return calls


def first_call_seconds(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int = 16
) -> dict[str, dict[str, float]]:
    """{kernel: {"first_s": compile or cache load + run, "second_s": run}}, each kernel in turn."""
    out = {}
    for name, call in kernel_calls(config, dtype, device, block_size).items():
        first = _timed(call, device)
        out[name] = {"first_s": first, "second_s": _timed(call, device)}
    return out
