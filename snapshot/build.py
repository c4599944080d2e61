"""`warmstart build`: an HF model directory in, a snapshot's blobs (in the local cache) and manifest out.

Weights are converted (and quantized) into the engine's layout and packed into one blob per decoder layer
plus one for embeddings, final norm and head; each prefix is run through the engine once and its full
blocks' KV stored in the pool's layout. Nothing here depends on time or machine, so the same inputs give
the same snapshot id.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from warmstart import runtime
from warmstart.runtime.engine.adapters import alignment_advice, wasted_slots
from warmstart.runtime.engine.dtype_choice import stored_dtype
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.tensor_parallel import TensorParallelError, check_divisible, shard_weights
from warmstart.runtime.generation_config import GenerationConfigError
from warmstart.runtime.generation_config import read_file as read_generation_config
from warmstart.runtime.models.config import ModelConfig, ModelConfigError, read_config_json
from warmstart.runtime.models.quantize import quantize_model
from warmstart.runtime.models.weights import DTYPES, ModelWeights, checkpoint_files, convert_weights, read_checkpoint
from warmstart.runtime.tokenizer import Tokenizer
from warmstart.snapshot.adapters import (
    PromptAdapter,
    build_selector,
    compile_prompt_adapter,
    merge_lora,
    read_examples,
    read_prompt_adapter,
)
from warmstart.snapshot.build_parts import (
    BlobWriter,
    BuildOptions,
    PrefixSpec,
    kv_blobs,
    pack_weights,
    prefix_engine,
    prefix_entry,
    tensor_bytes,
)
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.errors import BuildError
from warmstart.snapshot.format import FORMAT, FORMAT_VERSION, Manifest, file_blob_id, kv_fingerprint
from warmstart.snapshot.lora import build_loras

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class BuiltSnapshot:
    manifest: Manifest
    blob_paths: dict[str, Path]  # every blob of the manifest, in the local cache

    @property
    def id(self) -> str:
        return self.manifest.id


def build_snapshot(
    model_dir: Path,
    options: BuildOptions,
    cache: BlobCache,
    log: Callable[[str], None] = lambda _: None,
    origin: Mapping[str, str] | None = None,
) -> BuiltSnapshot:
    """``origin``: where the model directory came from (a hub id and its revision), kept in the provenance."""
    options.validate()
    options = replace(options, dtype=stored_dtype(options.dtype))
    model_dir = Path(model_dir)
    config_raw = _read_config(model_dir)
    config = ModelConfig.from_dict(config_raw, source=str(model_dir / "config.json"))
    try:
        generation_config = read_generation_config(model_dir)
    except GenerationConfigError as e:
        raise BuildError(str(e)) from None
    world = options.tensor_parallel
    try:
        check_divisible(config, world)
    except TensorParallelError as e:
        raise BuildError(str(e)) from None
    dtype = DTYPES[options.dtype]
    log(f"converting weights ({options.dtype}, quantization {options.quant})")
    raw = read_checkpoint(model_dir)
    if options.lora is not None:
        merged = merge_lora(raw, options.lora)
        log(f"merged LoRA {options.lora} into {len(merged)} weight(s)")
    weights = convert_weights(raw, config, dtype, source=str(model_dir))
    del raw
    if options.quant != "none":
        try:
            weights = quantize_model(weights, options.quant, options.group_size)
        except ValueError as e:
            raise BuildError(f"--quant {options.quant}: {e}") from None
    blobs = BlobWriter(cache)
    loras = build_loras(options.loras, config, dtype, blobs, log)
    if world == 1:
        tensors = pack_weights(weights, blobs)
        rank_tensors, rank_quantized = [tensors], [weights.quant_meta()]
    else:
        log(f"sharding weights for {world} tensor-parallel ranks")
        shards = [shard_weights(weights, config, r, world) for r in range(world)]
        rank_tensors = [pack_weights(shard, blobs) for shard in shards]
        rank_quantized = [shard.quant_meta() for shard in shards]
        tensors = {}
    rank_weight_blobs = [sorted({t["blob"] for t in ts.values()}) for ts in rank_tensors]
    tokenizer_blobs = {
        name: blobs.add_file(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).is_file()
    }
    group_sizes = {m.get("group_size") for m in weights.quant_meta().values()} - {None}
    quantization = {"scheme": options.quant, "group_size": group_sizes.pop() if len(group_sizes) == 1 else None}
    fingerprints = [kv_fingerprint(wb, quantization, options.dtype, options.block_size, runtime.__version__)
                    for wb in rank_weight_blobs]
    tokenizer = Tokenizer(model_dir) if "tokenizer.json" in tokenizer_blobs else None
    token_lists = [_prefix_tokens(p, tokenizer) for p in options.prefixes]
    prompt_adapters = [read_prompt_adapter(a, config) for a in options.adapters]
    prefixes, adapters = [], []
    if token_lists or prompt_adapters:
        engine = prefix_engine(config, weights, options, max([len(t) for t in token_lists] +
                                                       [a.num_tokens for a in prompt_adapters]))
        for spec, token_ids in zip(options.prefixes, token_lists, strict=True):
            log(f"computing prefix KV for {spec.name!r} ({prefix_coverage(len(token_ids), options.block_size)})")
            prefixes.append(prefix_entry(spec, token_ids, engine, blobs, world))
        for adapter in prompt_adapters:
            adapters.append(_adapter_entry(adapter, engine, blobs, log, world))
    selector = _selector_entry(options, tokenizer, weights, blobs, log) if options.adapter_examples else None
    draft = None
    if options.draft is not None:
        from warmstart.snapshot.draft import build_draft

        draft = build_draft(Path(options.draft), model_dir, config, options, prefixes, blobs, log)
    data: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": {"architecture": config.architecture, "config": config_raw},
        "engine": {"dtype": options.dtype, "block_size": options.block_size, "version": runtime.__version__},
        "quantization": quantization,
        "tensors": tensors,
        "quantized": rank_quantized[0] if world == 1 else {},
        "tokenizer": tokenizer_blobs,
        "fingerprint": fingerprints[0] if world == 1 else None,
        "prefixes": prefixes,
        "adapters": adapters,
        "adapter_selector": selector,
        "blobs": dict(sorted(blobs.sizes.items())),
        "provenance": {
            "tool": f"warmstart {runtime.__version__}",
            "torch": torch.__version__.split("+")[0],
            "sources": _source_hashes(model_dir, options),
            "options": {"quant": options.quant, "group_size": options.group_size, "dtype": options.dtype,
                        "block_size": options.block_size, "lora": options.lora is not None},
        },
    }
    if origin:  # absent for a local directory, so that its ids stay what they were
        data["provenance"]["model"] = dict(origin)
    if loras:  # LoRA adapters served unmerged (snapshot/lora.py); absent otherwise, so older ids stay the same
        data["loras"] = loras
    if generation_config is not None:  # the model's extra EOS ids and recommended sampling (serve applies them)
        data["generation_config"] = generation_config
    if draft is not None:
        data["draft"] = draft
        data["provenance"]["options"].update(draft_quant=options.draft_quant, draft_group_size=options.draft_group_size)
    if world > 1:
        shared = set(tokenizer_blobs.values()) | ({selector["blob"]} if selector else set())
        data["tensor_parallel"] = {"size": world, "ranks": [
            {"tensors": rank_tensors[r], "quantized": rank_quantized[r], "fingerprint": fingerprints[r],
             "blobs": sorted(shared | set(rank_weight_blobs[r])
                             | {e["rank_blobs"][r] for e in prefixes + adapters if e["rank_blobs"][r]})}
            for r in range(world)
        ]}
        data["provenance"]["options"]["tensor_parallel"] = world
    manifest = Manifest(data)
    cache.add_manifest(manifest.id, manifest.encode())
    return BuiltSnapshot(manifest, blobs.paths)


def _read_config(model_dir: Path) -> dict[str, Any]:
    if not model_dir.is_dir():
        raise BuildError(f"{model_dir} is not a directory; give an HF model directory")
    try:
        return read_config_json(model_dir)
    except ModelConfigError as e:
        raise BuildError(str(e)) from None


def _prefix_tokens(spec: PrefixSpec, tokenizer: Tokenizer | None) -> list[int]:
    flag = "--prefix" if spec.kind == "text" else "--system"
    try:
        text = spec.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BuildError(f"{flag} {spec.name}: cannot read {spec.path} as UTF-8 text ({e})") from None
    if not text:
        raise BuildError(f"{flag} {spec.name}: {spec.path} is empty")
    if tokenizer is None:
        raise BuildError(f"{flag} {spec.name}: the model directory has no tokenizer.json to tokenize it with")
    if spec.kind == "text":
        tokens = tokenizer.encode(text)
    elif tokenizer.chat_template is None:
        raise BuildError(f"--system {spec.name}: the model has no chat template; use --prefix for raw text")
    else:
        tokens = tokenizer.system_prompt_tokens(text)
    if not tokens:
        raise BuildError(f"{flag} {spec.name}: {spec.path} gives no tokens")
    return tokens


def _adapter_entry(
    adapter: PromptAdapter, engine: LLMEngine, blobs: BlobWriter, log: Callable[[str], None], world: int
) -> dict[str, Any]:
    kv = compile_prompt_adapter(adapter, engine)
    bs = engine.options.block_size
    waste = wasted_slots(adapter.num_tokens, bs)
    log(f"adapter {adapter.name!r}: {adapter.kind}, {adapter.num_tokens} virtual tokens, {waste} of "
        f"{kv.shape[3] * bs} KV slots unused at block size {bs}"
        + ("" if not waste else f"; {alignment_advice(adapter.num_tokens, bs)}"))
    entry = {"name": adapter.name, "kind": adapter.kind, "num_virtual_tokens": adapter.num_tokens,
             "wasted_slots": waste, "base_model": adapter.base_model, "blob": None,
             "dtype": str(kv.dtype).removeprefix("torch."), "shape": list(kv.shape)}
    entry.update(kv_blobs(kv, blobs, world))
    return entry


def _selector_entry(options: BuildOptions, tokenizer: Tokenizer | None, weights: ModelWeights, blobs: BlobWriter,
                    log: Callable[[str], None]) -> dict[str, Any]:
    if tokenizer is None:
        raise BuildError("--adapter-examples: the model directory has no tokenizer.json to read the examples with")
    report = build_selector({e.name: read_examples(e) for e in options.adapter_examples}, tokenizer, weights.embed)
    if report.accuracy is None:
        log("adapter selector: too few examples to hold any out (give 5 or more per adapter to measure it)")
    else:
        log(f"adapter selector: {report.accuracy:.1%} of {report.held_out} held-out examples routed right, "
            f"{report.microseconds_per_query:.0f} us per query")
    centroids = report.selector.centroids
    blob, _ = blobs.add_packed([tensor_bytes(centroids)])
    return {"names": report.selector.names, "blob": blob, "dtype": "float32", "shape": list(centroids.shape),
            "held_out": report.held_out, "accuracy": report.accuracy}


def _source_hashes(model_dir: Path, options: BuildOptions) -> dict[str, str]:
    files = [model_dir / "config.json", *checkpoint_files(model_dir)]
    files += [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files.append(index)
    out = {f.name: file_blob_id(f) for f in files}
    for p in options.prefixes:
        out[f"{'prefix' if p.kind == 'text' else 'system'}:{p.name}"] = file_blob_id(p.path)
    for a in options.adapters:
        out[f"adapter:{a.name}"] = file_blob_id(a.path / "adapter_model.safetensors")
    for a in options.loras:
        out[f"lora:{a.name}"] = file_blob_id(a.path / "adapter_model.safetensors")
    for e in options.adapter_examples:
        out[f"adapter-examples:{e.name}"] = file_blob_id(e.path)
    if options.lora is not None:
        out["lora"] = file_blob_id(options.lora / "adapter_model.safetensors")
    return dict(sorted(out.items()))


def prefix_coverage(num_tokens: int, block_size: int) -> str:
    """What of a prefix requests will find cached: its whole KV blocks (a partial last block is never shared)."""
    cached = num_tokens // block_size * block_size
    if not cached:
        return (f"{num_tokens} tokens, under one {block_size}-token KV block: nothing of it can be served from the "
                "cache; a longer prefix or a smaller --block-size would be")
    rest = f", the last {num_tokens - cached} computed per request" if num_tokens > cached else ""
    return f"{num_tokens} tokens: {cached} served from the prefix cache{rest}"
