"""Read an HF checkpoint (one or many safetensors files) into the engine's layout: fused QKV and gate/up."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from warmstart.runtime.kernels.cpu_gemv import gemv_serves
from warmstart.runtime.layers.linear import LinearWeight, packing_dtype
from warmstart.runtime.models.config import ModelConfig, ModelConfigError
from warmstart.runtime.models.huge_pages import HugePageArena
from warmstart.runtime.quant.formats import QuantizedExperts, from_tensors
from warmstart.runtime.quant.packed_linear import PackedWeight

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINEAR_FIELDS = ("qkv", "o_proj", "gate_up", "down")  # a layer's matrices, which quantize and prepack


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # None with reordered norms (OLMo 2), which normalize the blocks' outputs
    qkv: LinearWeight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim], or [q_size] with reordered norms
    k_norm: torch.Tensor | None
    o_proj: LinearWeight
    # after attention: on the residual sum, or with reordered (OLMo 2) or sandwich (Gemma 3) norms on o_proj's output
    post_norm: torch.Tensor
    gate_up: LinearWeight | None  # [2 * intermediate, hidden]; None in a layer of experts
    down: LinearWeight | None
    mlp_out_norm: torch.Tensor | None = None  # reordered and sandwich norms: on the MLP's output
    mlp_in_norm: torch.Tensor | None = None  # sandwich norms: on the MLP's input
    # A layer of experts (Mixture-of-Experts) in place of gate_up and down: the router [experts, hidden], and every
    # expert's matrices stacked, [experts, 2 * expert intermediate, hidden] and [experts, hidden, intermediate]
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | QuantizedExperts | None = None
    experts_down: torch.Tensor | QuantizedExperts | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: LinearWeight  # the embedding itself when tied

    def _named(self) -> dict[str, LinearWeight]:
        out: dict[str, LinearWeight] = {"embed": self.embed, "norm": self.norm}
        if self.lm_head is not self.embed:
            out["lm_head"] = self.lm_head
        for i, layer in enumerate(self.layers):
            for name, t in vars(layer).items():
                if t is not None:
                    out[f"layers.{i}.{name}"] = t
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by a stable name (engine layout), for snapshots and size accounting; a quantized
        weight's tensors are named ``<weight>.<part>`` (see ``quant_meta``)."""
        out = {}
        for name, t in self._named().items():
            if isinstance(t, torch.Tensor):
                out[name] = t
            else:
                out.update((f"{name}.{part}", p) for part, p in t.tensors().items())
        return out

    def quant_meta(self) -> dict[str, dict[str, Any]]:
        """Each quantized weight's meta by name, for ``runtime.quant.from_tensors``; empty when none is."""
        return {name: t.meta() for name, t in self._named().items() if not isinstance(t, torch.Tensor)}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("'weight_map' must map tensor names to file names")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelConfigError(f"{index} is malformed ({e}); expected a 'weight_map' object") from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(
            f"{model_dir} holds no *.safetensors weights (pytorch_model.bin checkpoints are not supported; "
            "re-save the model with safe_serialization=True)"
        )
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelConfigError(f"{model_dir}: the index names shard(s) that are not there: {', '.join(missing)}")
    return files


def load_weights(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype) -> ModelWeights:
    return convert_weights(read_checkpoint(model_dir), config, dtype, source=str(model_dir))


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint by name, without the ``model.`` prefix."""
    model_dir = Path(model_dir)
    raw: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    raw[name.removeprefix("model.")] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelConfigError(f"cannot read {path}: {e}") from None
    return raw


def convert_weights(
    raw: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype, source: str = "checkpoint"
) -> ModelWeights:
    """HF tensors (names without the ``model.`` prefix) -> engine layout, checking every shape."""
    c = config
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = raw.get(name)
        if t is None:
            raise ModelConfigError(f"{source}: tensor {name!r} is missing from the checkpoint")
        if tuple(t.shape) != shape:
            raise ModelConfigError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        used.add(name)
        return t.to(dtype)

    def fused(*parts: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts, dim=0).contiguous()

    h, d = c.hidden_size, c.head_dim
    moe = c.moe
    q_norm_shape, k_norm_shape = ((c.q_size,), (c.kv_size,)) if c.reordered_norms else ((d,), (d,))
    layers = []
    for i in range(c.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        layers.append(
            LayerWeights(
                input_norm=None if c.reordered_norms else get(p + "input_layernorm.weight", (h,)),
                qkv=get(a + "qkv_proj.weight", (c.q_size + 2 * c.kv_size, h)) if c.fused_checkpoint else fused(
                    get(a + "q_proj.weight", (c.q_size, h)),
                    get(a + "k_proj.weight", (c.kv_size, h)),
                    get(a + "v_proj.weight", (c.kv_size, h)),
                ),
                qkv_bias=fused(
                    get(a + "q_proj.bias", (c.q_size,)),
                    get(a + "k_proj.bias", (c.kv_size,)),
                    get(a + "v_proj.bias", (c.kv_size,)),
                )
                if c.qkv_bias
                else None,
                q_norm=get(a + "q_norm.weight", q_norm_shape) if c.qk_norm else None,
                k_norm=get(a + "k_norm.weight", k_norm_shape) if c.qk_norm else None,
                o_proj=get(a + "o_proj.weight", (h, c.q_size)),
                post_norm=get(p + "post_attention_layernorm.weight", (h,)),
                gate_up=None if moe and moe.layers[i] else
                get(p + "mlp.gate_up_proj.weight", (2 * c.intermediate_size, h)) if c.fused_checkpoint
                else fused(
                    get(p + "mlp.gate_proj.weight", (c.intermediate_size, h)),
                    get(p + "mlp.up_proj.weight", (c.intermediate_size, h)),
                ),
                down=None if moe and moe.layers[i] else get(p + "mlp.down_proj.weight", (h, c.intermediate_size)),
                **(_experts(get, p, c) if moe and moe.layers[i] else {}),
                mlp_out_norm=get(p + "post_feedforward_layernorm.weight", (h,))
                if c.reordered_norms or c.sandwich_norms else None,
                mlp_in_norm=get(p + "pre_feedforward_layernorm.weight", (h,)) if c.sandwich_norms else None,
            )
        )
    embed = get("embed_tokens.weight", (c.vocab_size, h))
    if c.tie_word_embeddings:
        lm_head = embed
        used.add("lm_head.weight")
    else:
        if "lm_head.weight" not in raw:
            raise ModelConfigError(
                f"{source}: config says tie_word_embeddings=false but the checkpoint has no 'lm_head.weight'"
            )
        lm_head = get("lm_head.weight", (c.vocab_size, h))
    norm = get("norm.weight", (h,))
    unexpected = sorted(k for k in raw if k not in used and "rotary_emb" not in k)
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise ModelConfigError(f"{source}: unexpected tensors for {c.architecture}: {shown}")
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)


# Where a checkpoint keeps a layer's experts: (MLP module, router, expert's gate, up, down)
_EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("block_sparse_moe", "gate", "w1", "w3", "w2")}


def _experts(get: Any, prefix: str, c: ModelConfig) -> dict[str, torch.Tensor]:
    """A layer's router and its experts' matrices, stacked: the HF checkpoint's one tensor per expert and matrix."""
    assert c.moe is not None
    mlp, router, gate, up, down = _EXPERT_NAMES[c.family]
    h, inter, p = c.hidden_size, c.moe.intermediate_size, f"{prefix}{mlp}."
    experts = range(c.moe.num_experts)
    return {
        "router": get(p + f"{router}.weight", (c.moe.num_experts, h)),
        "experts_gate_up": torch.stack([torch.cat([get(p + f"experts.{e}.{gate}.weight", (inter, h)),
                                                   get(p + f"experts.{e}.{up}.weight", (inter, h))]) for e in experts]),
        "experts_down": torch.stack([get(p + f"experts.{e}.{down}.weight", (h, inter)) for e in experts]),
    }


def weights_to(weights: ModelWeights, device: torch.device) -> ModelWeights:
    """The same weights with every tensor on ``device`` (itself when it is already there). A quantized weight is
    rebuilt from its moved tensors, in the layout it was stored in (which the Triton matmuls read)."""
    if weights.embed.device == device:
        return weights

    def move(w: Any) -> Any:
        if w is None or isinstance(w, torch.Tensor):
            return w if w is None else w.to(device)
        return from_tensors(w.meta(), {name: t.to(device) for name, t in w.tensors().items()})

    layers = [LayerWeights(**{name: move(w) for name, w in vars(layer).items()}) for layer in weights.layers]
    embed = weights.embed.to(device)
    lm_head = embed if weights.lm_head is weights.embed else move(weights.lm_head)
    return ModelWeights(embed=embed, layers=layers, norm=weights.norm.to(device), lm_head=lm_head)


def prepack_in_background(*models: ModelWeights) -> threading.Thread:
    """Pack the decoder's float linear layers and the head in place (runtime/quant/packed_linear.py), one by
    one, on a background thread.

    The engine serves from the plain weights meanwhile and picks up each packed one at its next use (the
    results are bit-identical), so packing adds nothing to a cold start's time to ready. The embedding
    stays as it is (a lookup; a tied head gets a packed copy). Where the few-row kernel serves, the plain weights it
    reads are copied into huge pages first (runtime/models/huge_pages.py): an anonymous copy of the linear weights
    in place of the snapshot's page-cache pages, which the kernel can then reclaim.
    """

    def pack_all() -> None:
        try:
            for weights in models:  # the model, then a speculative draft model if there is one
                _pack(weights)
        except (RuntimeError, MemoryError) as e:  # the plain weights keep serving: slower, never wrong
            log.warning("prepacking the weights failed, serving from the plain ones: %s", str(e).splitlines()[0])

    # Not a daemon: a process that exits while a reorder is running inside oneDNN aborts (SIGABRT); at exit
    # the interpreter waits for the thread instead (a fraction of a second at most).
    thread = threading.Thread(target=pack_all, name="warmstart-prepack")
    thread.start()
    return thread


def _pack(weights: ModelWeights) -> None:
    plain = [getattr(layer, name) for layer in weights.layers for name in LINEAR_FIELDS] + [weights.lm_head]
    plain = [w for w in plain if isinstance(w, torch.Tensor)]
    if not plain:
        return
    # The few-row kernel reads the plain weights once per decode step: in huge pages (huge_pages.py) where it serves.
    arena = HugePageArena(HugePageArena.room_for(plain)) if gemv_serves(plain[0].device, plain[0].dtype) else None
    compute = packing_dtype(plain[0].dtype)

    def pack(w: torch.Tensor) -> PackedWeight:
        return PackedWeight(arena.copy(w) if arena is not None else w, compute)

    for layer in weights.layers:
        for name in LINEAR_FIELDS:
            w = getattr(layer, name)
            if isinstance(w, torch.Tensor):
                setattr(layer, name, pack(w))
    if isinstance(weights.lm_head, torch.Tensor):
        weights.lm_head = pack(weights.lm_head)
