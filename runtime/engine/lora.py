"""LoRA adapters served unmerged: many at once over one base, each request picking its own.

An adapter is held in the engine's fused layout (``LoraWeights``): per layer, for each of the four fused
linears ("qkv", "o_proj", "gate_up", "down") it targets, ``A`` [slices * rank, in_features] and ``B``
[out_features, rank] with PEFT's scaling folded into B. A fused linear's output rows are its slices'
(q, k, v or gate, up) one after another; output rows of slice s take ``B[rows of s] @ A[s * rank:(s + 1) *
rank]``, so the fused delta is block diagonal: ``delta[rows of s] = B[rows of s] @ A[s-th rank rows]``.
Slices an adapter does not target are zero, modules it does not target are absent. Ranks below the
adapter's largest (PEFT's rank_pattern) are zero-padded.

The engine's API (runtime/engine/engine.py, LLMEngine):

- ``add_lora(name, load, rank)`` registers an adapter; ``load()`` returns its LoraWeights and is called
  when a request first needs it (at admission, on the step loop) and again whenever it is paged back in.
  ``rank`` (its largest) is checked against ``EngineOptions.max_lora_rank`` at once.
- ``remove_lora(name)`` forgets it (ValueError while a request uses it); ``loras.names()`` lists the names.
- Requests pick one with ``add_request(..., adapter=name)``, as compiled adapters are picked.
- ``EngineOptions.max_loras`` adapters are resident at once (stacked in device slots); one beyond that is
  paged in at admission over the least recently used one that no running request uses; a request whose
  adapter cannot get a slot yet waits (others behind it go on).
- ``loras.stats`` (LoraStats): load seconds (sum and count), hits (already resident at admission) and misses
  (paged in), for /metrics; load errors: a ``load()`` that raises aborts the requests waiting for that adapter
  (finish_reason "abort", ``last_load_error`` says why), never the step loop.
- Prefix caching: a LoRA request's block hashes chain from its adapter's own root (fresh per ``add_lora``), so
  cached KV is never shared across adapters or with the base. Decode batches carrying LoRA run without CUDA
  graphs and without the fused CPU decode layer; tensor parallelism is refused.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from warmstart.runtime.layers.lora import LoraSlots, LoraStep, lora_step
from warmstart.runtime.models.config import ModelConfig

# The engine's fused linears and the PEFT (HF) modules they are made of, in the order of their output rows.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
HF_MODULES = {hf: (fused, i) for fused, parts in FUSED_MODULES.items() for i, hf in enumerate(parts)}
# Checkpoints that fuse them too (Phi-3): one LoRA over every slice, its A shared by them
HF_FUSED_MODULES = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn", "gate_up_proj": "mlp"}
FORMAT_VERSION = 1
_PEFT_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


def slice_sizes(config: ModelConfig, module: str) -> tuple[int, list[int]]:
    """A fused linear's (in_features, out_features of each slice)."""
    c = config
    if module == "qkv":
        return c.hidden_size, [c.q_size, c.kv_size, c.kv_size]
    if module == "o_proj":
        return c.q_size, [c.hidden_size]
    if module == "gate_up":
        return c.hidden_size, [c.intermediate_size, c.intermediate_size]
    if module == "down":
        return c.intermediate_size, [c.hidden_size]
    raise ValueError(f"no fused linear {module!r}; expected one of {', '.join(FUSED_MODULES)}")


@dataclass
class LoraWeights:
    """One LoRA adapter in the engine's fused layout, ready to serve (see the module docstring)."""

    name: str
    rank: int  # the largest rank of its modules; every module's A and B are padded to it
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: fused module -> (A, B)
    targets: list[str] = field(default_factory=list)  # the HF modules it adapts (q_proj, ...), sorted

    def modules(self) -> Iterator[tuple[int, str, torch.Tensor, torch.Tensor]]:
        for i, layer in enumerate(self.layers):
            for module in FUSED_MODULES:
                if module in layer:
                    yield i, module, *layer[module]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat, safetensors-able: ``layers.{i}.{module}.lora_a`` / ``.lora_b``."""
        out = {}
        for i, module, a, b in self.modules():
            out[f"layers.{i}.{module}.lora_a"] = a.contiguous()
            out[f"layers.{i}.{module}.lora_b"] = b.contiguous()
        return out

    def meta(self) -> dict[str, Any]:
        """JSON-able: what ``from_tensors`` checks the tensors against."""
        return {
            "format": FORMAT_VERSION,
            "rank": self.rank,
            "num_layers": len(self.layers),
            "targets": list(self.targets),
            "shapes": {k: list(t.shape) for k, t in self.tensors().items()},
        }

    @classmethod
    def from_tensors(cls, name: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> LoraWeights:
        """Inverse of ``tensors`` and ``meta``; ValueError when they do not fit together."""
        what = f"LoRA adapter {name!r}"
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{what}: format {meta.get('format')!r}; this engine reads format {FORMAT_VERSION} "
                             "(rebuild the adapter with this version of warmstart)")
        rank, num_layers, shapes = int(meta["rank"]), int(meta["num_layers"]), meta["shapes"]
        if set(shapes) != set(tensors):
            missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
            raise ValueError(f"{what}: tensors do not match its metadata (missing {missing[:3]}, extra {extra[:3]})")
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(num_layers)]
        for key, shape in shapes.items():
            t = tensors[key]
            if list(t.shape) != list(shape):
                raise ValueError(f"{what}: tensor {key} has shape {list(t.shape)}, its metadata says {shape}")
            _check_finite(what, key, t)
        for key in shapes:
            m = re.fullmatch(r"layers\.(\d+)\.(\w+)\.lora_a", key)
            if m is None:
                continue
            i, module = int(m[1]), m[2]
            if module not in FUSED_MODULES or i >= num_layers or f"layers.{i}.{module}.lora_b" not in tensors:
                raise ValueError(f"{what}: unexpected tensor {key}")
            a, b = tensors[key], tensors[f"layers.{i}.{module}.lora_b"]
            if a.shape[0] != len(FUSED_MODULES[module]) * rank or b.shape[1] != rank:
                raise ValueError(f"{what}: {key} does not have rank {rank}")
            layers[i][module] = (a, b)
        return cls(name, rank, layers, list(meta.get("targets", [])))

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for _, _, a, b in self.modules())

    def check_fits(self, config: ModelConfig) -> None:
        """ValueError unless every tensor has the shape this model's fused linears need."""
        if len(self.layers) != config.num_layers:
            raise ValueError(f"LoRA adapter {self.name!r} has {len(self.layers)} layers, the model "
                             f"{config.num_layers} (an adapter for another base model?)")
        for i, module, a, b in self.modules():
            fan_in, outs = slice_sizes(config, module)
            want_a, want_b = (len(outs) * self.rank, fan_in), (sum(outs), self.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(f"LoRA adapter {self.name!r}: layer {i} {module} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}; this model needs {want_a} and {want_b} (an adapter for another "
                                 "base model?)")

    def delta(self, layer: int, module: str, config: ModelConfig) -> torch.Tensor:
        """The fused linear's weight update [out, in] in float32 (zero where untargeted): for tests and merging."""
        fan_in, outs = slice_sizes(config, module)
        if module not in self.layers[layer]:
            return torch.zeros(sum(outs), fan_in)
        a, b = (t.float() for t in self.layers[layer][module])
        parts, row = [], 0
        for s, out in enumerate(outs):
            parts.append(b[row : row + out] @ a[s * self.rank : (s + 1) * self.rank])
            row += out
        return torch.cat(parts)


# -- PEFT in --------------------------------------------------------------------------------------------------

_REFUSED_OPTIONS = (
    ("use_dora", "DoRA adapters"),
    ("modules_to_save", "adapters with modules_to_save (fully trained extra modules)"),
    ("lora_bias", "LoRA with lora_bias (a trained bias on B)"),
    ("fan_in_fan_out", "fan_in_fan_out adapters (for Conv1D models such as GPT-2)"),
    ("target_parameters", "adapters with target_parameters"),
    ("use_qalora", "QALoRA adapters"),
    ("trainable_token_indices", "adapters with trainable_token_indices (trained embedding rows)"),
    ("alora_invocation_tokens", "activated LoRA (aLoRA) adapters"),
    ("layer_replication", "adapters with layer_replication"),
    ("use_bdlora", "block-diagonal LoRA (BD-LoRA) adapters"),
    ("arrow_config", "Arrow adapters"),
    ("kasa_config", "KaSA adapters"),
    ("monteclora_config", "MonteCLoRA adapters"),
)


def lora_from_peft(
    name: str, peft_config: dict[str, Any], peft_tensors: dict[str, torch.Tensor], config: ModelConfig,
    dtype: torch.dtype,
) -> LoraWeights:  # fmt: skip
    """PEFT LoraConfig (adapter_config.json as a dict) + adapter_model tensors -> the fused layout in ``dtype``.

    Scaling as PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, per module with
    rank_pattern (read from the tensors' shapes) and alpha_pattern. ValueError saying what is wrong for anything
    else: another PEFT type, DoRA, modules_to_save, bias, embedding or lm_head LoRA, modules outside
    q/k/v/o/gate/up/down, shapes of another base model."""
    what = f"LoRA adapter {name!r}"
    _check_peft_config(what, peft_config)
    pairs = _peft_pairs(what, peft_tensors, config)
    alpha_default = peft_config.get("lora_alpha", 8)
    alpha_pattern = peft_config.get("alpha_pattern") or {}
    rank = max(ab["A"].shape[0] for ab in pairs.values())
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    for (layer, hf_module), ab in sorted(pairs.items()):
        module, s = (HF_FUSED_MODULES[hf_module], -1) if hf_module in HF_FUSED_MODULES else HF_MODULES[hf_module]
        fan_in, outs = slice_sizes(config, module)
        slices = range(len(outs)) if s < 0 else [s]
        a, b = ab["A"].float(), ab["B"].float()
        _check_finite(what, f"layer {layer} {hf_module} lora_A", a)
        _check_finite(what, f"layer {layer} {hf_module} lora_B", b)
        r = a.shape[0]
        out_rows = sum(outs[i] for i in slices)
        if a.shape != (r, fan_in) or b.shape != (out_rows, r):
            raise ValueError(f"{what}: layer {layer} {hf_module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; this model needs ({r}, {fan_in}) and ({out_rows}, {r}) "
                             "(an adapter for another base model?)")
        alpha = float(peft_pattern_value(alpha_pattern, f"model.layers.{layer}.{_PARENT[hf_module]}.{hf_module}",
                                     alpha_default))
        scale = alpha / math.sqrt(r) if peft_config.get("use_rslora") else alpha / r
        if module not in layers[layer]:
            layers[layer][module] = (torch.zeros(len(outs) * rank, fan_in), torch.zeros(sum(outs), rank))
        fused_a, fused_b = layers[layer][module]
        b_row = 0
        for i in slices:
            fused_a[i * rank : i * rank + r] = a
            row = sum(outs[:i])
            fused_b[row : row + outs[i], :r] = b[b_row : b_row + outs[i]] * scale
            b_row += outs[i]
    for i, layer_modules in enumerate(layers):
        for module, (a, b) in layer_modules.items():
            layer_modules[module] = (a.to(dtype), b.to(dtype))
            _check_finite(what, f"layer {i} {module} lora_B scaled to {str(dtype).removeprefix('torch.')}",
                          layer_modules[module][1])
    targets = sorted({hf for _, hf in pairs})
    return LoraWeights(name, rank, layers, targets)


def _check_finite(what: str, tensor_name: str, t: torch.Tensor) -> None:
    """ValueError for NaN or infinite values: an adapter's rows share the batched LoRA add with other requests',
    and a NaN there (times the zeros of their padding) would empty their outputs too."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{what}: tensor {tensor_name} holds {bad} NaN or infinite values; an adapter must be "
                         "finite (retrain it, or check the file it came from)")


def _check_peft_config(what: str, peft_config: dict[str, Any]) -> None:
    kind = peft_config.get("peft_type")
    if kind != "LORA":
        raise ValueError(f"{what}: adapter type {kind!r}; only LORA adapters are served unmerged")
    for key, description in _REFUSED_OPTIONS:
        if peft_config.get(key):
            raise ValueError(f"{what}: {description} are not supported; merge it with peft's merge_and_unload() "
                             "and serve the merged model instead")
    if peft_config.get("bias", "none") != "none":
        raise ValueError(f"{what}: LoRA with bias={peft_config['bias']!r} is not supported; only bias='none'")


def _peft_pairs(
    what: str, peft_tensors: dict[str, torch.Tensor], config: ModelConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, HF module) -> {"A": lora_A, "B": lora_B}, refusing any tensor that is not one of those."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in peft_tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            where = "embedding or lm_head LoRA, " if ("embed" in key or "lm_head" in key) else ""
            raise ValueError(f"{what}: unexpected tensor {key!r} ({where}trained extra modules and LoRA outside the "
                             "decoder layers' q/k/v/o/gate/up/down projections are not supported)")
        layer, module = int(m["layer"]), m["module"]
        if module not in _PARENT or _PARENT[module] != m["parent"]:
            raise ValueError(f"{what}: LoRA on {m['parent']}.{module} is not supported; targets may be "
                             f"{', '.join(_PARENT)}")
        if layer >= config.num_layers:
            raise ValueError(f"{what}: targets layer {layer}, the model has {config.num_layers} layers "
                             "(an adapter for another base model?)")
        if m["parent"] == "mlp" and config.moe is not None and config.moe.layers[layer]:
            raise ValueError(f"{what}: LoRA on layer {layer}'s experts is not supported; target the attention "
                             "(q/k/v/o) of a Mixture-of-Experts model")
        if tensor.dim() != 2:
            raise ValueError(f"{what}: {key} has shape {tuple(tensor.shape)}; expected a matrix")
        pairs.setdefault((layer, module), {})[m["ab"]] = tensor
    if not pairs:
        raise ValueError(f"{what}: the adapter holds no LoRA weights")
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{what}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        if ab["A"].shape[0] != ab["B"].shape[1] or ab["A"].shape[0] < 1:
            raise ValueError(f"{what}: layer {layer} {module}: lora_A {tuple(ab['A'].shape)} and lora_B "
                             f"{tuple(ab['B'].shape)} do not share a rank")
    return pairs


def peft_pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override: a key matches a module name that ends with it (as a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# -- residency ------------------------------------------------------------------------------------------------


@dataclass
class LoraStats:
    """Counters for /metrics: adapters paged in (misses) and found resident (hits) at admission, load seconds."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    load_errors: int = 0  # page-ins whose load() raised: the requests waiting for that adapter were aborted
    last_load_error: str | None = None


class LoraLoadError(Exception):
    """An adapter's load() failed when a request needed it (a blob gone or corrupt): that request is aborted."""


@dataclass
class RegisteredLora:
    name: str
    load: Callable[[], LoraWeights]
    rank: int
    # Chains the prefix cache's block hashes of its requests (in place of NO_PARENT): their KV is the adapter's,
    # never shared with the base's or another adapter's, nor with an earlier adapter of the same name.
    hash_root: int


class LoraManager:
    """The registered adapters and the ``max_loras`` device slots they are paged into (see the module docstring)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.max_loras, self.max_rank, self.dtype, self.device = config, max_loras, max_rank, dtype, device
        self.registered: dict[str, RegisteredLora] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently admitted first
        self.slots: LoraSlots | None = None  # allocated with the first adapter
        self.stats = LoraStats()
        self._serial = itertools.count(1)

    def __contains__(self, name: object) -> bool:
        return name in self.registered

    def names(self) -> list[str]:
        return sorted(self.registered)

    def add(self, name: str, load: Callable[[], LoraWeights], rank: int) -> None:
        if name in self.registered:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first to replace it")
        if not isinstance(rank, int) or not 1 <= rank <= self.max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank!r}; this engine serves ranks 1 to {self.max_rank} "
                             "(raise max_lora_rank, serve --max-lora-rank)")
        root = xxhash.xxh3_64_intdigest(f"lora\0{name}\0{next(self._serial)}".encode()) | 1  # never NO_PARENT (0)
        self.registered[name] = RegisteredLora(name, load, rank, root)
        if self.slots is None:
            shapes = {m: slice_sizes(self.config, m) for m in FUSED_MODULES}
            self.slots = LoraSlots.empty(self.max_loras, self.max_rank, shapes, self.config.num_layers, self.dtype,
                                         self.device)

    def remove(self, name: str) -> None:
        self.registered.pop(name)
        slot = self.resident.pop(name, None)
        if slot is not None and self.slots is not None:
            self.slots.clear(slot)

    def hash_root(self, name: str) -> int:
        return self.registered[name].hash_root

    def slot(self, name: str) -> int:
        return self.resident[name]

    def acquire(self, name: str, busy: set[str]) -> bool:
        """Make ``name`` resident for a request being admitted: a hit, a free slot, or the least recently admitted
        adapter out that no request in ``busy`` uses. False, changing nothing, when every slot is busy."""
        if name in self.resident:
            self.resident.move_to_end(name)
            self.stats.hits += 1
            return True
        slot = next((s for s in range(self.max_loras) if s not in self.resident.values()), None)
        if slot is None:
            victim = next((n for n in self.resident if n not in busy), None)
            if victim is None:
                return False
            slot = self.resident.pop(victim)
        try:
            self._page_in(self.registered[name], slot)
        except Exception as e:  # whatever the caller's loader raises; the slot stays free
            self.stats.load_errors += 1
            self.stats.last_load_error = f"LoRA adapter {name!r} could not be loaded: {e}"
            raise LoraLoadError(self.stats.last_load_error) from e
        self.resident[name] = slot
        self.stats.misses += 1
        return True

    def _page_in(self, entry: RegisteredLora, slot: int) -> None:
        assert self.slots is not None
        start = time.perf_counter()
        self.slots.clear(slot)
        weights = entry.load()
        weights.check_fits(self.config)
        if weights.rank > entry.rank:
            raise ValueError(f"LoRA adapter {entry.name!r} loaded with rank {weights.rank}, registered as {entry.rank}")
        self.slots.fill(slot, weights.rank, weights.layers)
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - start

    def step(self, row_slots: list[int]) -> LoraStep | None:
        """The layout of a step whose flat-batch rows carry these slots (-1: none)."""
        if self.slots is None:
            return None
        return lora_step(row_slots, self.slots, self.device)
