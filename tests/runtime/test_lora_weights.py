"""LoRA adapters in the engine's fused layout (runtime/engine/lora.py): every fused module's delta equals PEFT's own
scaled B @ A (get_delta_weight) for rank and alpha patterns, rsLoRA, partial targets and layers; the flat tensors
and metadata round-trip through safetensors; anything else is refused with a message saying what."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.peft_reference import _hf, make_adapter
from warmstart.runtime.engine.lora import FUSED_MODULES, LoraWeights, lora_from_peft
from warmstart.runtime.models.config import ModelConfig

CASES: dict[str, dict[str, Any]] = {
    "qv": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "patterns": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"],
                 "rank_pattern": {"q_proj": 8, "layers.1.mlp.down_proj": 2}, "alpha_pattern": {"down_proj": 3}},
    "rslora-mlp": {"r": 6, "lora_alpha": 12, "use_rslora": True, "target_modules": ["gate_proj", "up_proj", "down_proj",
                                                                                     "o_proj"]},
    "one-layer": {"r": 2, "lora_alpha": 5, "target_modules": ["k_proj", "up_proj"], "layers_to_transform": [1]},
}


def read_peft(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    return config, load_file(str(adapter_dir / "adapter_model.safetensors"))


def peft_delta(model: Any, layer: int, module: str, config: ModelConfig) -> torch.Tensor:
    """PEFT's delta of each HF module of a fused one (zero where it has no LoRA), stacked as the engine fuses them."""
    parts = []
    for hf in FUSED_MODULES[module]:
        parent = "self_attn" if hf in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        linear = getattr(getattr(model.base_model.model.model.layers[layer], parent), hf)
        base = linear.base_layer.weight if hasattr(linear, "base_layer") else linear.weight
        has_lora = hasattr(linear, "lora_A") and "default" in linear.lora_A
        parts.append(linear.get_delta_weight("default").float() if has_lora else torch.zeros_like(base).float())
    return torch.cat(parts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_deltas_equal_peft(tiny_model_dir, tmp_path: Path, case: str) -> None:
    model_dir = tiny_model_dir("qwen2")
    config = ModelConfig.from_dir(model_dir)
    adapter_dir = make_adapter(model_dir, tmp_path / case, "LoraConfig", seed=3, **CASES[case])
    lora = lora_from_peft(case, *read_peft(adapter_dir), config, torch.float32)
    lora.check_fits(config)
    model = peft.PeftModel.from_pretrained(_hf(model_dir), adapter_dir).eval()
    targeted = 0
    for layer in range(config.num_layers):
        for module in FUSED_MODULES:
            ours, theirs = lora.delta(layer, module, config), peft_delta(model, layer, module, config)
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            targeted += bool(theirs.abs().sum() > 0)
            assert (module in lora.layers[layer]) == bool(theirs.abs().sum() > 0)  # untargeted modules absent
    assert targeted > 0
    ranks = [CASES[case]["r"], *CASES[case].get("rank_pattern", {}).values()]
    assert lora.rank == max(ranks)


def test_tensors_and_meta_round_trip_through_safetensors(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    config = ModelConfig.from_dir(model_dir)
    adapter_dir = make_adapter(model_dir, tmp_path / "a", "LoraConfig", seed=1, **CASES["patterns"])
    lora = lora_from_peft("a", *read_peft(adapter_dir), config, torch.bfloat16)
    save_file(lora.tensors(), str(tmp_path / "blob.safetensors"))
    meta = json.loads(json.dumps(lora.meta()))
    back = LoraWeights.from_tensors("a", meta, load_file(str(tmp_path / "blob.safetensors")))
    back.check_fits(config)
    assert back.rank == lora.rank == 8 and back.targets == lora.targets
    assert back.nbytes() == lora.nbytes() == sum(t.nbytes for t in lora.tensors().values())
    for (i, m, a, b), (j, n, a2, b2) in zip(lora.modules(), back.modules(), strict=True):
        assert (i, m) == (j, n) and a2.dtype == torch.bfloat16
        assert torch.equal(a, a2) and torch.equal(b, b2)


def test_from_tensors_refuses_what_does_not_fit(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    config = ModelConfig.from_dir(model_dir)
    lora = lora_from_peft("a", *read_peft(make_adapter(model_dir, tmp_path / "a", "LoraConfig", seed=1,
                                                       **CASES["qv"])), config, torch.float32)
    tensors, meta = lora.tensors(), lora.meta()
    key = next(iter(tensors))
    with pytest.raises(ValueError, match="missing"):
        LoraWeights.from_tensors("a", meta, {k: v for k, v in tensors.items() if k != key})
    with pytest.raises(ValueError, match="has shape"):
        LoraWeights.from_tensors("a", meta, {**tensors, key: tensors[key][:, :3]})
    with pytest.raises(ValueError, match="format"):
        LoraWeights.from_tensors("a", {**meta, "format": 99}, tensors)
    other = ModelConfig.from_dir(tiny_model_dir("qwen3"))
    with pytest.raises(ValueError, match="another base model"):
        lora.check_fits(other)


REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "dora": ({"use_dora": True}, "DoRA"),
    "bias": ({"bias": "all"}, "bias='all'"),
    "prompt": ({"peft_type": "PROMPT_TUNING"}, "only LORA adapters"),
    "lora_bias": ({"lora_bias": True}, "lora_bias"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unsupported_configs_are_refused(tiny_model_dir, tmp_path: Path, case: str) -> None:
    model_dir = tiny_model_dir("llama")
    config = ModelConfig.from_dir(model_dir)
    peft_config, tensors = read_peft(make_adapter(model_dir, tmp_path / "a", "LoraConfig", seed=1, **CASES["qv"]))
    change, message = REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        lora_from_peft("a", {**peft_config, **change}, tensors, config, torch.float32)


@pytest.mark.parametrize(("targets", "message"), [(["embed_tokens", "q_proj"], "embedding or lm_head LoRA"),
                                                  (["lm_head"], "embedding or lm_head LoRA")])
def test_embedding_and_head_lora_are_refused(tiny_model_dir, tmp_path: Path, targets: list[str], message: str) -> None:
    model_dir = tiny_model_dir("llama")
    config = ModelConfig.from_dir(model_dir)
    adapter = make_adapter(model_dir, tmp_path / "a", "LoraConfig", seed=1, r=2, target_modules=targets)
    with pytest.raises(ValueError, match=message):
        lora_from_peft("a", *read_peft(adapter), config, torch.float32)


def test_tensors_of_another_model_or_broken_pairs_are_refused(tiny_model_dir, tmp_path: Path) -> None:
    llama = ModelConfig.from_dir(tiny_model_dir("llama"))
    peft_config, tensors = read_peft(make_adapter(tiny_model_dir("qwen3"), tmp_path / "a", "LoraConfig", seed=1,
                                                  **CASES["qv"]))
    with pytest.raises(ValueError, match="another base model"):
        lora_from_peft("a", peft_config, tensors, llama, torch.float32)
    qwen3 = ModelConfig.from_dir(tiny_model_dir("qwen3"))
    a_key = next(k for k in tensors if "lora_A" in k)
    with pytest.raises(ValueError, match="lora_B missing|lora_A missing"):
        lora_from_peft("a", peft_config, {a_key: tensors[a_key]}, qwen3, torch.float32)
    with pytest.raises(ValueError, match="holds no LoRA weights"):
        lora_from_peft("a", peft_config, {}, qwen3, torch.float32)
    with pytest.raises(ValueError, match="not supported"):
        lora_from_peft("a", peft_config, {"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight":
                                          tensors[a_key]}, qwen3, torch.float32)


@pytest.mark.parametrize(("tensor", "value"), [("lora_B", float("nan")), ("lora_A", float("inf")),
                                               ("lora_B", -float("inf"))])  # fmt: skip
def test_non_finite_adapters_are_refused_naming_the_tensor(tiny_model_dir, tmp_path: Path, tensor: str,
                                                            value: float) -> None:  # fmt: skip
    """Issue 40, 4: a NaN adapter emptied other adapters' outputs in the same batch; it must not get in."""
    model_dir = tiny_model_dir("llama")
    config = ModelConfig.from_dir(model_dir)
    peft_config, tensors = read_peft(make_adapter(model_dir, tmp_path / "a", "LoraConfig", seed=3, **CASES["qv"]))
    key = next(k for k in sorted(tensors) if ".layers.1." in k and "v_proj" in k and tensor in k)
    tensors[key][0, 0] = value
    with pytest.raises(ValueError, match=f"tensor layer 1 v_proj {tensor} holds 1 NaN or infinite values"):
        lora_from_peft("bad", peft_config, tensors, config, torch.bfloat16)


def test_an_adapter_whose_scaling_overflows_its_dtype_is_refused(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    config = ModelConfig.from_dir(model_dir)
    peft_config, tensors = read_peft(make_adapter(model_dir, tmp_path / "a", "LoraConfig", seed=3, **CASES["qv"]))
    key = next(k for k in sorted(tensors) if ".layers.0." in k and "q_proj" in k and "lora_B" in k)
    tensors[key][0, 0] = 60_000.0  # finite in float32 and float16; scaled by alpha / r = 4, past float16's 65504
    lora_from_peft("fine", peft_config, tensors, config, torch.bfloat16)
    with pytest.raises(ValueError, match="tensor layer 0 qkv lora_B scaled to float16 holds 1 NaN or infinite"):
        lora_from_peft("bad", peft_config, tensors, config, torch.float16)


def test_stored_tensors_that_are_not_finite_are_refused_at_load(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    config = ModelConfig.from_dir(model_dir)
    peft_config, tensors = read_peft(make_adapter(model_dir, tmp_path / "a", "LoraConfig", seed=3, **CASES["qv"]))
    lora = lora_from_peft("ok", peft_config, tensors, config, torch.float32)
    stored = lora.tensors()
    key = sorted(stored)[0]
    stored[key] = stored[key].clone()
    stored[key].view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match=f"tensor {key} holds 1 NaN or infinite values"):
        LoraWeights.from_tensors("ok", lora.meta(), stored)
