"""How far a quantized model is from its float original (logit error, top-1 and greedy agreement): the
evaluation behind benchmarks/quant_quality.py, kept out of the runtime because it builds whole engines."""

from __future__ import annotations

import torch

from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.layers.attention import AttentionGroup, AttentionMetadata
from warmstart.runtime.models.model import Model
from warmstart.runtime.sampling_params import SamplingParams


def compare_to_float(
    float_model: Model, quant_model: Model, prompts: list[list[int]], max_tokens: int = 16
) -> dict[str, float]:
    """How far a quantized model is from its float original:

    - max/mean abs logit difference over every position of every prompt (teacher-forced on the prompt), and
      the fraction of those positions whose top token is the same;
    - greedy agreement: the fraction of prompts whose ``max_tokens`` greedy tokens all match, and the mean
      length of the matching prefix of those tokens (one early difference changes everything after it, so
      this is the harsher measure).
    """
    logits = [(prompt_logits(float_model, p), prompt_logits(quant_model, p)) for p in prompts]
    diffs = [(f - q).abs() for f, q in logits]
    same_top = sum(int((f.argmax(-1) == q.argmax(-1)).sum()) for f, q in logits)
    outputs = []
    for model in (float_model, quant_model):
        blocks = len(prompts) * (-(-(max(map(len, prompts)) + max_tokens) // 16) + 1)
        engine = LLMEngine(model, None, EngineOptions(num_kv_blocks=blocks, max_num_seqs=len(prompts)))
        for p in prompts:
            engine.add_request(list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        outputs.append([done[k] for k in sorted(done, key=lambda r: int(r.split("-")[1]))])
    prefixes = [_matching_prefix(f, q) for f, q in zip(*outputs, strict=True)]
    return {
        "max_abs_logit_diff": max(float(d.max()) for d in diffs),
        "mean_abs_logit_diff": float(torch.cat([d.flatten() for d in diffs]).mean()),
        "top1_agreement": same_top / sum(map(len, prompts)),
        "greedy_agreement": sum(n == max_tokens for n in prefixes) / len(prompts),
        "mean_matching_prefix": sum(prefixes) / len(prompts),
        "max_tokens": max_tokens,
    }


def _matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@torch.inference_mode()
def prompt_logits(model: Model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """float32 logits at every position of one prompt, run as a single prefill chunk in a private KV pool."""
    c, n = model.config, len(token_ids)
    blocks = -(-n // block_size)
    shape = (2, c.num_kv_heads, blocks, block_size, c.head_dim)
    caches = [torch.zeros(shape, dtype=model.dtype) for _ in range(c.num_layers)]
    positions = torch.arange(n)
    group = AttentionGroup(
        rows=slice(0, n), block_tables=torch.arange(blocks)[None], query_positions=positions,
        first_key_position=0, is_decode=False, block_size=block_size,
    )
    meta = AttentionMetadata(slot_mapping=positions, groups=[group])
    return model.forward(torch.tensor(token_ids), positions, caches, meta, positions)
