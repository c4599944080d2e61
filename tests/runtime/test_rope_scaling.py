"""Every rope scaling the config reads gives transformers' own inverse frequencies and attention scale, bit for bit
(transformers.modeling_rope_utils is the reference; Llama 3.x, Llama 2's linear interpolation and Qwen's yarn
configs use them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from warmstart.runtime.models.config import ModelConfig, ModelConfigError, rope_inv_freq

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100, "rope_theta": 10000.0,
        "max_position_embeddings": 4096}


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3,
     "truncate": False},
], ids=["linear", "llama3", "yarn", "yarn-mscale", "yarn-attention-factor"])
def test_inverse_frequencies_and_scale_are_transformers(scaling: dict[str, Any]) -> None:
    raw = {**BASE, "rope_scaling": scaling}
    ours, scale = rope_inv_freq(ModelConfig.from_dict(raw))
    reference = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    theirs, their_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](reference, torch.device("cpu"))
    assert torch.equal(ours, theirs.to(ours.dtype)) and scale == pytest.approx(their_scale, rel=1e-12)


def test_a_rope_scaling_it_does_not_compute_is_refused_by_name() -> None:
    with pytest.raises(ModelConfigError, match=r"rope scaling type 'longrope' is not supported \(supported: "):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
