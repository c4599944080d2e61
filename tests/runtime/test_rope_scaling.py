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
    with pytest.raises(ModelConfigError, match=r"rope scaling type 'dynamic' is not supported \(supported: "):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})


PHI3 = {**BASE, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096}
SHORT, LONG = [1.0 + 0.07 * i for i in range(16)], [1.0 + 0.9 * i for i in range(16)]


@pytest.mark.parametrize("scaling", [
    {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},  # Phi-3-mini-128k's form: scale from 32x
    {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "attention_factor": 1.25},
    {"type": "su", "short_factor": SHORT, "long_factor": LONG},  # its early name
], ids=["longrope", "longrope-attention-factor", "su"])
def test_longrope_is_phi3s_short_factors_within_the_original_context(scaling: dict[str, Any]) -> None:
    from transformers import Phi3Config

    config = ModelConfig.from_dict({**PHI3, "rope_scaling": scaling})
    ours, scale = rope_inv_freq(config)
    reference = Phi3Config(**{k: v for k, v in PHI3.items() if k != "architectures"},
                           rope_scaling={**scaling, "type": "longrope"})  # fmt: skip
    theirs, their_scale = ROPE_INIT_FUNCTIONS["longrope"](reference, torch.device("cpu"))  # seq_len None: short
    assert torch.equal(ours, theirs) and scale == pytest.approx(their_scale, rel=1e-12)
    # transformers moves every position to the long factors past the original context, cached keys included:
    # the context served is the original one, where the short factors are exact
    assert config.max_position_embeddings == 4096


def test_a_partial_rotary_rotates_its_share_of_a_head() -> None:
    """Phi-4-mini: 3/4 of each head rotates, with LongRoPE factors for those dimensions alone."""
    from transformers import Phi3Config

    short = SHORT[:12]
    raw = {**PHI3, "partial_rotary_factor": 0.75,
           "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": LONG[:12]}}
    config = ModelConfig.from_dict(raw)
    assert (config.head_dim, config.rotary_dim) == (32, 24)
    ours, scale = rope_inv_freq(config)
    reference = Phi3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "rope_scaling")},
                           rope_scaling={**raw["rope_scaling"], "type": "longrope"})  # fmt: skip
    theirs, their_scale = ROPE_INIT_FUNCTIONS["longrope"](reference, torch.device("cpu"))
    assert torch.equal(ours, theirs) and scale == pytest.approx(their_scale, rel=1e-12)
    with pytest.raises(ModelConfigError, match="partial_rotary_factor=0.3 gives 9 rotary dimensions"):
        ModelConfig.from_dict({**PHI3, "partial_rotary_factor": 0.3})
