"""peft as the reference for adapters: saving random adapters that matter, and greedy decoding through them.

With transformers 5, ``PeftModel.generate`` drops the adapter after the first token (and ignores prefix
tuning), while the plain forward pass applies it; so the reference decodes greedily by repeated forward
passes of the PeftModel over the whole sequence.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import peft
import torch


def _hf(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: Path, out: Path, kind: str, seed: int, **options: Any) -> Path:
    """Save a PEFT adapter with random parameters large enough to change the output."""
    torch.manual_seed(seed)
    config = getattr(peft, kind)(task_type="CAUSAL_LM", **options)
    model = peft.get_peft_model(_hf(model_dir), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "lora_B" in name:
                p.normal_(0, 0.05)
            elif p.requires_grad and ("prompt_encoder" in name or "embedding" in name):
                p.mul_(2.0 if "PrefixTuning" in kind else 1.0)
    model.save_pretrained(out)
    return out


@functools.cache
def _peft_model(model_dir: Path, adapter_dir: Path):  # type: ignore[no-untyped-def]
    return peft.PeftModel.from_pretrained(_hf(model_dir), adapter_dir).eval()


def peft_logits(model_dir: Path, adapter_dir: Path, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _peft_model(model_dir, adapter_dir)(input_ids=torch.tensor([token_ids])).logits[0, -1]


def assert_matches_peft(model_dir: Path, adapter_dir: Path, prompt: list[int], ours: list[int]) -> None:
    """Greedy by repeated forward passes of the PeftModel; a difference is allowed only at a near-tie."""
    seq = list(prompt)
    for i, token in enumerate(ours):
        logits = peft_logits(model_dir, adapter_dir, seq)
        ref = int(logits.argmax())
        if token != ref:
            top = logits.topk(2).values
            gap = float(top[0] - top[1])
            assert gap < 1e-3, f"token {i}: ours {token}, peft {ref}, top-2 gap {gap:.2e} (not a near-tie)"
            return
        seq.append(token)
