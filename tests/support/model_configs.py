"""Tiny configs for every supported family, with odd shapes, for correctness tests against transformers.

All have max_position_embeddings >= 512 and vocabularies larger than or equal to the tokenizer's.
"""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 2,
}

FAMILIES: dict[str, dict[str, Any]] = {
    # GQA ratio 2, head_dim (48) != hidden / heads (96 / 4 = 24), untied head.
    "llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": 1000,
    },
    # Llama 3.x rope scaling, tied embeddings, GQA ratio 4.
    "llama3": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": 1024,
    },
    # Llama 2 style linear rope scaling (position interpolation), MHA, 3 layers.
    "llama2_linear": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": 768,
    },
    # Sliding window shorter than test prompts. transformers: key j visible from query i iff 0 <= i - j < 24.
    "mistral": {
        **_COMMON,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "sliding_window": 24,
        "tie_word_embeddings": False,
        "vocab_size": 800,
    },
    # q/k/v biases (o_proj has none), tied, GQA ratio 3.
    "qwen2": {
        **_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 96,
        "intermediate_size": 224,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
        "vocab_size": 896,
    },
    # q_norm / k_norm over head_dim, explicit head_dim 32 with hidden 64 and 4 heads, GQA ratio 2.
    "qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
        "vocab_size": 1024,
    },
    # Reordered norms: on each block's output (no input norm), q/k norms over all heads at once, GQA ratio 2.
    "olmo2": {
        **_COMMON,
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": 832,
    },
    # Fused qkv_proj and gate_up_proj in the checkpoint, LongRoPE (short factors, scale from 1024 / 512), a sliding
    # window shorter than the test prompts.
    "phi3": {
        **_COMMON,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 64,
        "intermediate_size": 144,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 512,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                         "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]},
        "sliding_window": 40,
        "tie_word_embeddings": False,
        "vocab_size": 704,
        "pad_token_id": 0,  # Phi3Config's default (32000) lies outside this vocabulary
    },
}
