"""Model hyperparameters read from an HF ``config.json``, with the per-family switches the engine needs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # the MLP's gate, by the config's name for it
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class MoeConfig:
    """A Mixture-of-Experts MLP: each token's top ``top_k`` of ``num_experts`` experts by the router's softmax."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    normalize: bool  # the top-k probabilities renormalized to sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob)
    weights_in_model_dtype: bool  # Qwen3-MoE rounds the routing weights to the model dtype; Mixtral keeps float32
    layers: tuple[bool, ...]  # which layers route (the others have one dense MLP of intermediate_size)


class ModelConfigError(ValueError):
    """The model directory holds something the engine cannot run; the message says what."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading dimensions of a head that rotate: head_dim, fewer with a partial_rotary_factor
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    qk_norm: bool
    # OLMo 2's reordered norms: on each block's output before the residual add (none on its input), q/k norms over
    # all heads at once (before the split into heads), every norm's weight multiplied in float32, rope in float32.
    reordered_norms: bool
    # Phi-3's checkpoint holds q/k/v as one qkv_proj and gate/up as one gate_up_proj, already in the engine's layout
    fused_checkpoint: bool
    activation: str  # of the MLP's gate: "silu" or "gelu_tanh" (GeGLU)
    attention_scale: float  # of q.k: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    embedding_multiplier: float  # Gemma's sqrt(hidden_size) on the token embeddings, else 1
    # Gemma 3's sandwich norms: around each block's input and output, their weights offset by 1 and multiplied in
    # float32 (q/k norms per head likewise)
    sandwich_norms: bool
    local_rope_theta: float | None  # Gemma 3's rope base on its sliding-window layers (theirs is plain rope)
    attention_softcap: float | None  # Gemma 2's: scores become cap * tanh(scores / cap) before the softmax
    final_softcap: float | None  # Gemma 2's, on the logits
    moe: MoeConfig | None  # Qwen3-MoE's and Mixtral's experts; None for a dense model
    tie_word_embeddings: bool
    # One entry per layer: the sliding window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides by the same one (then old blocks can be freed), else None."""
        windows = set(self.sliding_windows)
        if len(windows) == 1:
            return next(iter(windows))
        return None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(model_dir), source=str(Path(model_dir) / "config.json"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                f"warmstart runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in raw:
                raise ModelConfigError(f"{source}: missing required field {key!r} for {arch}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        num_layers = int(need("num_hidden_layers"))
        gemma = _gemma(raw, source, num_layers, family) if family in ("gemma2", "gemma3") else {}
        raw = {**raw, **gemma.pop("raw", {})}
        act_name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act_name not in ACTIVATIONS:
            raise ModelConfigError(f"{source}: hidden_act={act_name!r} is not supported "
                                   f"(supported: {', '.join(ACTIVATIONS)})")
        if raw.get("mlp_bias"):
            raise ModelConfigError(f"{source}: mlp_bias=true is not supported")
        if family == "olmo2" and raw.get("attention_bias"):
            raise ModelConfigError(f"{source}: attention_bias=true is not supported for {arch} (its o_proj bias)")

        rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        rope_theta = float(raw.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0)
        partial_rotary = float(raw.get("partial_rotary_factor") or (rope_scaling or {}).get("partial_rotary_factor")
                               or 1.0)
        rotary_dim = int(head_dim * partial_rotary)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ModelConfigError(f"{source}: partial_rotary_factor={partial_rotary} gives {rotary_dim} rotary "
                                   f"dimensions of a head of {head_dim}; they must be even and at most head_dim")
        max_positions = int(raw.get("max_position_embeddings") or 2048)
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_type = "longrope" if rope_type == "su" else rope_type  # early Phi-3 configs' name for it
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelConfigError(
                    f"{source}: rope scaling type {rope_type!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
            rope_scaling = {**rope_scaling, "rope_type": rope_type}
            if rope_type == "default":
                rope_scaling = None
            elif rope_type == "longrope":
                rope_scaling, max_positions = _longrope(rope_scaling, raw, max_positions, source)

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias")),
            qk_norm=family in ("qwen3", "olmo2", "gemma3", "qwen3_moe"),
            reordered_norms=family == "olmo2",
            fused_checkpoint=family == "phi3",
            activation=ACTIVATIONS[act_name],
            attention_scale=float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            embedding_multiplier=hidden**0.5 if gemma else 1.0,
            sandwich_norms=bool(gemma),
            local_rope_theta=gemma.get("local_rope_theta"),
            attention_softcap=gemma.get("attention_softcap"),
            final_softcap=gemma.get("final_softcap"),
            moe=_moe(raw, family, num_layers) if family in ("qwen3_moe", "mixtral") else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(raw, family, num_layers),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _moe(raw: dict[str, Any], family: str, num_layers: int) -> MoeConfig:
    if family == "mixtral":
        return MoeConfig(int(raw.get("num_local_experts") or 8), int(raw.get("num_experts_per_tok") or 2),
                         int(raw["intermediate_size"]), True, False, (True,) * num_layers)
    step, dense = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or [])
    experts = int(raw.get("num_experts") or 0)
    layers = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoeConfig(experts, int(raw.get("num_experts_per_tok") or 8), int(raw.get("moe_intermediate_size") or 0),
                     bool(raw.get("norm_topk_prob", False)), True, layers)


def _gemma(raw: dict[str, Any], source: str, num_layers: int, family: str) -> dict[str, Any]:
    """Gemma 2's and 3's config in the form the rest reads: their layer types (every sliding_window_pattern-th layer
    global: 2 for Gemma 2, 6 for Gemma 3), Gemma 3's global layers' rope as rope_theta / rope_scaling and its local
    layers' base apart, Gemma 2's soft-capping."""
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{source}: use_bidirectional_attention=true (an encoder) is not supported")
    softcaps = {"attention_softcap": raw.get("attn_logit_softcapping"),
                "final_softcap": raw.get("final_logit_softcapping")}
    pattern = int(raw.get("sliding_window_pattern") or (2 if family == "gemma2" else 6))
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if family == "gemma2":
        return {"raw": {"layer_types": layer_types}, **softcaps}
    by_type = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    by_type = by_type if by_type and "full_attention" in by_type else {}
    full, local = by_type.get("full_attention") or {}, by_type.get("sliding_attention") or {}
    scaling = raw.get("rope_scaling") or ({k: v for k, v in full.items() if k != "rope_theta"} or None)
    return {
        "raw": {"layer_types": layer_types, "rope_theta": full.get("rope_theta") or raw.get("rope_theta") or 1e6,
                "rope_scaling": scaling, "rope_parameters": None},
        "local_rope_theta": float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0),
        **softcaps,
    }


def _longrope(scaling: dict[str, Any], raw: dict[str, Any], max_positions: int,
              source: str) -> tuple[dict[str, Any], int]:  # fmt: skip
    """LongRoPE (Phi-3): its short factors, and the cos/sin scale transformers derives from the context's growth.
    transformers switches every position to the long factors once a sequence passes the original context, keys
    already cached included; served up to the original context, the short factors alone are exact, so that is
    the model's context here."""
    original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if not original or "short_factor" not in scaling:
        raise ModelConfigError(f"{source}: longrope scaling needs short_factor and original_max_position_embeddings")
    original = int(original)
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    scaling = {**scaling, "original_max_position_embeddings": original, "attention_factor": float(attention_factor)}
    return scaling, min(max_positions, original)


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """An HF model directory's config.json as a dict, or a ModelConfigError saying what is wrong."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{model_dir} has no config.json: expected an HF model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} must hold a JSON object")
    return raw


def _sliding_windows(raw: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None and family in ("qwen2", "qwen3", "qwen3_moe"):
        first_sliding = int(raw.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first_sliding else "full" for i in range(num_layers)]
    if layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale, computed exactly as transformers does for each rope type."""
    dim = config.rotary_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "longrope":
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (short * base**shape), float(scaling["attention_factor"])
    if rope_type == "llama3":
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    return _yarn_inv_freq(config, scaling, factor)


def _yarn_inv_freq(config: ModelConfig, scaling: dict[str, Any], factor: float) -> tuple[torch.Tensor, float]:
    dim = config.rotary_dim
    base = config.rope_theta
    original_max = scaling.get("original_max_position_embeddings") or config.max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)
