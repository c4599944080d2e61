"""PEFT adapters in, compiled at build time: soft prompts and prefix tuning become pinned prefix KV, a LoRA given
to --lora-merge is merged into the weights (LoRA served unmerged: snapshot/lora.py), and example queries become
the "auto" selector's centroids.

``PeftModel.save_pretrained`` already runs a prompt encoder (P-tuning's MLP or LSTM, prefix tuning's
projection) and saves its output as ``prompt_embeddings``: virtual-token embeddings [n, hidden] for
PROMPT_TUNING and P_TUNING, per-layer keys and values [n, layers * 2 * kv_heads * head_dim] for
PREFIX_TUNING. What is left to compile is the base model's pass over the virtual tokens (their KV) or,
for prefix tuning, only a change of layout.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from warmstart.runtime.engine.adapters import AdapterSelector, pooled_embedding, to_blocks
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.lora import peft_pattern_value
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.tokenizer import Tokenizer
from warmstart.snapshot.errors import BuildError

PROMPT_TYPES = ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING")
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
HELD_OUT_EVERY = 5  # every fifth example of an adapter measures the selector instead of shaping it


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: Path

    @classmethod
    def parse(cls, text: str, flag: str = "--adapter") -> AdapterSpec:
        name, sep, path = text.partition("=")
        if not sep or not ADAPTER_NAME.match(name) or not path or name == "auto":
            raise BuildError(f"{flag} {text!r}: expected NAME=PATH with NAME made of letters, digits, '_', '.', '-' "
                             "(and not 'auto', which asks for the selector)")
        return cls(name, Path(path))


@dataclass
class PromptAdapter:
    """A prompt-learning adapter as PEFT saved it."""

    name: str
    kind: str  # one of PROMPT_TYPES
    embeddings: torch.Tensor  # prompt_embeddings, see the module docstring
    base_model: str | None

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[0])


def read_adapter_config(path: Path, what: str) -> dict[str, Any]:
    config_path = path / "adapter_config.json"
    if not path.is_dir() or not config_path.is_file():
        raise BuildError(f"{what}: {path} is not a PEFT adapter directory (no adapter_config.json); "
                         "give the directory PeftModel.save_pretrained wrote")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BuildError(f"{what}: cannot read {config_path} ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("peft_type"), str):
        raise BuildError(f"{what}: {config_path} has no 'peft_type'; is it a PEFT adapter?")
    return config


def read_adapter_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        found = "adapter_model.bin" if (path / "adapter_model.bin").is_file() else "nothing"
        raise BuildError(f"{what}: {path} has no adapter_model.safetensors (found {found}); "
                         "save the adapter with safe_serialization=True")
    try:
        with safe_open(str(weights), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise BuildError(f"{what}: cannot read {weights}: {e}") from None


def read_prompt_adapter(spec: AdapterSpec, config: ModelConfig) -> PromptAdapter:
    what = f"--adapter {spec.name}"
    peft_config = read_adapter_config(spec.path, what)
    kind = peft_config["peft_type"]
    if kind == "LORA":
        raise BuildError(f"{what}: {spec.path} is a LoRA adapter; merge it into the weights with --lora-merge DIR, "
                         "or serve it unmerged with --lora NAME=DIR")
    if kind not in PROMPT_TYPES:
        raise BuildError(f"{what}: adapter type {kind!r} is not supported; --adapter takes "
                         f"{', '.join(PROMPT_TYPES)} (and --lora / --lora-merge take LORA)")
    if peft_config.get("num_transformer_submodules", 1) != 1:
        raise BuildError(f"{what}: an adapter for an encoder-decoder model; warmstart serves decoder-only models")
    embeddings = read_adapter_tensors(spec.path, what).get("prompt_embeddings")
    if embeddings is None:
        raise BuildError(f"{what}: {spec.path}/adapter_model.safetensors holds no 'prompt_embeddings' tensor; "
                         "save the adapter with PeftModel.save_pretrained")
    n = peft_config.get("num_virtual_tokens")
    if kind == "PREFIX_TUNING":
        width = config.num_layers * 2 * config.kv_size
        layout = f"{config.num_layers} layers x 2 x {config.num_kv_heads} KV heads x {config.head_dim}"
    else:
        width, layout = config.hidden_size, "the hidden size"
    if embeddings.dim() != 2 or embeddings.shape[0] != n or embeddings.shape[1] != width:
        raise BuildError(
            f"{what}: prompt_embeddings has shape {tuple(embeddings.shape)}; this model needs ({n}, {width}) "
            f"({n} virtual tokens, {layout}). Was the adapter trained for another base model?"
        )
    if not 1 <= n <= 4096:
        raise BuildError(f"{what}: {n} virtual tokens; expected 1 to 4096")
    return PromptAdapter(spec.name, kind, embeddings.float(), peft_config.get("base_model_name_or_path"))


def compile_prompt_adapter(adapter: PromptAdapter, engine: LLMEngine) -> torch.Tensor:
    """The adapter's KV in the pool's block layout: the base model's pass over soft prompts, or prefix
    tuning's vectors rearranged (PEFT lays them out [n, layers * 2 (K, V), kv_heads, head_dim])."""
    c = engine.config
    dtype = engine.runner.model.dtype
    if adapter.kind != "PREFIX_TUNING":
        return engine.prefixes.virtual_tokens_kv(adapter.embeddings.to(dtype))
    n = adapter.num_tokens
    kv = adapter.embeddings.to(dtype).view(n, c.num_layers, 2, c.num_kv_heads, c.head_dim).permute(1, 2, 3, 0, 4)
    return to_blocks(kv, engine.options.block_size)


# -- LoRA ----------------------------------------------------------------------------------------------------

_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def merge_lora(raw: dict[str, torch.Tensor], path: Path) -> list[str]:
    """Add a LoRA adapter's scaled B @ A to the HF tensors it targets (names without ``model.``), in float32,
    as PEFT's merge does; returns the merged tensors' names. Anything not a plain LoRA is refused."""
    what = f"--lora-merge {path}"
    config = read_adapter_config(path, what)
    if config["peft_type"] != "LORA":
        raise BuildError(f"{what}: adapter type {config['peft_type']!r}; --lora-merge takes LORA adapters "
                         "(prompt-learning adapters go in with --adapter NAME=DIR)")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("layers_to_transform", None)):
        if config.get(key):
            raise BuildError(f"{what}: {why or key} adapters are not supported; merge it with peft's "
                             "merge_and_unload() and build the merged model instead")
    if config.get("bias", "none") != "none":
        raise BuildError(f"{what}: LoRA with bias={config['bias']!r} is not supported; only bias='none'")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in read_adapter_tensors(path, what).items():
        m = _LORA_KEY.match(key)
        if m is None:
            raise BuildError(f"{what}: unexpected tensor {key!r} (embedding LoRA and trained extra modules are "
                             "not supported)")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise BuildError(f"{what}: the adapter holds no LoRA weights")
    merged = []
    for module, ab in sorted(pairs.items()):
        name = module + ".weight"
        if set(ab) != {"A", "B"}:
            raise BuildError(f"{what}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        if name not in raw:
            raise BuildError(f"{what}: targets {module}, which this model does not have "
                             "(an adapter for another base model?)")
        delta = ab["B"].float() @ ab["A"].float()
        if config.get("fan_in_fan_out"):
            delta = delta.T
        if tuple(delta.shape) != tuple(raw[name].shape):
            raise BuildError(f"{what}: {module} update has shape {tuple(delta.shape)}, the model's weight "
                             f"{tuple(raw[name].shape)} (an adapter for another base model?)")
        rank = ab["A"].shape[0]
        alpha = peft_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        raw[name] = (raw[name].float() + scale * delta).to(raw[name].dtype)
        merged.append(name)
    return merged


# -- the "auto" selector -------------------------------------------------------------------------------------


@dataclass
class SelectorReport:
    selector: AdapterSelector
    held_out: int  # examples measured
    accuracy: float | None  # on them; None when no adapter had enough examples to hold any out
    microseconds_per_query: float


def read_examples(spec: AdapterSpec) -> list[str]:
    what = f"--adapter-examples {spec.name}"
    try:
        lines = [line.strip() for line in spec.path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise BuildError(f"{what}: cannot read {spec.path} as UTF-8 text ({e})") from None
    examples = [line for line in lines if line]
    if not examples:
        raise BuildError(f"{what}: {spec.path} holds no example queries (one per line)")
    return examples


def build_selector(examples: dict[str, list[str]], tokenizer: Tokenizer, embed: torch.Tensor) -> SelectorReport:
    """Nearest-centroid selector over mean-pooled input embeddings; its accuracy is measured on every
    HELD_OUT_EVERY-th example with centroids fitted without them, then the centroids are refitted on all."""
    names = sorted(examples)
    pooled = {n: [pooled_embedding(tokenizer.encode(q, add_special_tokens=False) or [0], embed)
                  for q in examples[n]] for n in names}

    def centroids(keep: Callable[[int], bool]) -> torch.Tensor:
        rows = []
        for n in names:
            kept = [v for i, v in enumerate(pooled[n]) if keep(i)] or pooled[n]
            mean = torch.stack(kept).mean(dim=0)
            rows.append(mean / mean.norm().clamp_min(1e-12))
        return torch.stack(rows)

    def held(i: int) -> bool:
        return i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1

    trial = AdapterSelector(names, centroids(lambda i: not held(i)))
    tests = [(n, q) for n in names for i, q in enumerate(examples[n]) if held(i)]
    token_lists = [tokenizer.encode(q, add_special_tokens=False) or [0] for _, q in tests]
    start = time.perf_counter()
    chosen = [trial.select(ids, embed) for ids in token_lists]
    elapsed = time.perf_counter() - start
    correct = sum(c == n for c, (n, _) in zip(chosen, tests, strict=True))
    accuracy = correct / len(tests) if tests else None
    per_query = 1e6 * elapsed / len(tests) if tests else 0.0
    return SelectorReport(AdapterSelector(names, centroids(lambda i: True)), len(tests), accuracy, per_query)
