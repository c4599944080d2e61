"""`warmstart build`: an HF model directory in, a snapshot's blobs (in the local cache) and manifest out.

Weights are converted (and quantized) into the engine's layout and packed into one blob per decoder layer
plus one for embeddings, final norm and head; each prefix is run through the engine once and its full
blocks' KV stored in the pool's layout. Nothing here depends on time or machine, so the same inputs give
the same snapshot id.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import runtime
from runtime.adapters import alignment_advice, wasted_slots
from runtime.config import ModelConfig, ModelConfigError, read_config_json
from runtime.engine import DTYPES, EngineOptions, LLMEngine
from runtime.model import Model
from runtime.quant import SCHEMES, quantize_model
from runtime.tensor_parallel import TensorParallelError, check_divisible, shard_kv, shard_weights
from runtime.tokenizer import Tokenizer
from runtime.weights import ModelWeights, checkpoint_files, convert_weights, read_checkpoint
from snapshot.adapters import (
    AdapterSpec,
    PromptAdapter,
    build_selector,
    compile_prompt_adapter,
    merge_lora,
    read_examples,
    read_prompt_adapter,
)
from snapshot.cache import BlobCache
from snapshot.errors import BuildError
from snapshot.format import FORMAT, FORMAT_VERSION, Manifest, file_blob_id, kv_fingerprint, write_packed

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PREFIX_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class PrefixSpec:
    name: str
    path: Path
    kind: str  # "text": tokenized as is; "system": a chat system prompt, rendered through the chat template

    @classmethod
    def parse(cls, text: str, kind: str) -> PrefixSpec:
        name, sep, path = text.partition("=")
        flag = "--prefix" if kind == "text" else "--system"
        if not sep or not PREFIX_NAME.match(name) or not path:
            raise BuildError(f"{flag} {text!r}: expected NAME=FILE with NAME made of letters, digits, '_', '.', '-'")
        return cls(name, Path(path), kind)


@dataclass
class BuildOptions:
    quant: str = "none"
    group_size: int | None = None  # None: the largest that fits every layer (runtime.quant decides)
    dtype: str = "bfloat16"
    block_size: int = 16
    prefixes: list[PrefixSpec] = field(default_factory=list)
    adapters: list[AdapterSpec] = field(default_factory=list)  # PEFT prompt-learning adapters
    adapter_examples: list[AdapterSpec] = field(default_factory=list)  # example queries per adapter, for "auto"
    lora: Path | None = None  # a LoRA adapter merged into the weights
    draft: Path | None = None  # a draft model's HF directory, for speculative decoding (snapshot.draft)
    draft_quant: str = "none"
    draft_group_size: int | None = None
    tensor_parallel: int = 1  # ranks the weights and KV are sharded for (runtime/tensor_parallel.py)

    def validate(self) -> None:
        if self.quant not in SCHEMES:
            raise BuildError(f"--quant must be one of {', '.join(SCHEMES)}, got {self.quant!r}")
        if self.draft_quant not in SCHEMES:
            raise BuildError(f"--draft-quant must be one of {', '.join(SCHEMES)}, got {self.draft_quant!r}")
        if self.dtype not in DTYPES:
            raise BuildError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise BuildError(f"--block-size must be >= 1, got {self.block_size}")
        if self.tensor_parallel < 1:
            raise BuildError(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.draft is not None:
            raise BuildError("--draft does not combine with --tensor-parallel yet; build without one of them")
        if self.tensor_parallel > 1 and self.quant not in ("none", "int8"):
            raise BuildError(f"--tensor-parallel {self.tensor_parallel} shards plain or int8 weights; --quant "
                             f"{self.quant}'s groups span the split (use --quant int8 or none)")
        names = [p.name for p in self.prefixes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise BuildError(f"prefix name(s) given twice: {', '.join(dupes)}")
        adapters = [a.name for a in self.adapters]
        for flag, given in (("--adapter", adapters), ("--adapter-examples", [e.name for e in self.adapter_examples])):
            dupes = sorted({n for n in given if given.count(n) > 1})
            if dupes:
                raise BuildError(f"{flag}: name(s) given twice: {', '.join(dupes)}")
        unknown = sorted({e.name for e in self.adapter_examples} - set(adapters))
        if unknown:
            raise BuildError(f"--adapter-examples for {', '.join(unknown)}, which no --adapter names")
        if self.adapter_examples and len(self.adapter_examples) != len(self.adapters):
            missing = sorted(set(adapters) - {e.name for e in self.adapter_examples})
            raise BuildError(f"--adapter-examples: the 'auto' selector needs examples for every adapter; "
                             f"missing for {', '.join(missing)}")


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
) -> BuiltSnapshot:
    options.validate()
    model_dir = Path(model_dir)
    config_raw = _read_config(model_dir)
    config = ModelConfig.from_dict(config_raw, source=str(model_dir / "config.json"))
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
    blobs = _BlobWriter(cache)
    if world == 1:
        tensors = _pack_weights(weights, blobs)
        rank_tensors, rank_quantized = [tensors], [weights.quant_meta()]
    else:
        log(f"sharding weights for {world} tensor-parallel ranks")
        shards = [shard_weights(weights, config, r, world) for r in range(world)]
        rank_tensors = [_pack_weights(shard, blobs) for shard in shards]
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
        engine = _engine(config, weights, options, max([len(t) for t in token_lists] +
                                                       [a.num_tokens for a in prompt_adapters]))
        for spec, token_ids in zip(options.prefixes, token_lists, strict=True):
            log(f"computing prefix KV for {spec.name!r} ({len(token_ids)} tokens)")
            prefixes.append(_prefix_entry(spec, token_ids, engine, blobs, world))
        for adapter in prompt_adapters:
            adapters.append(_adapter_entry(adapter, engine, blobs, log, world))
    selector = _selector_entry(options, tokenizer, weights, blobs, log) if options.adapter_examples else None
    draft = None
    if options.draft is not None:
        from snapshot.draft import build_draft

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


class _BlobWriter:
    """Writes blobs into the cache's staging area and moves them in under their content hash."""

    def __init__(self, cache: BlobCache) -> None:
        self.cache = cache
        self.paths: dict[str, Path] = {}
        self.sizes: dict[str, int] = {}

    def add_packed(self, parts: list[Any]) -> tuple[str, list[tuple[int, int]]]:
        with tempfile.TemporaryDirectory(dir=self.cache.root) as tmp:
            path = Path(tmp) / "blob"
            spans = write_packed(path, parts)
            return self._adopt(path, file_blob_id(path), move=True), spans

    def add_file(self, path: Path) -> str:
        return self._adopt(path, file_blob_id(path), move=False)

    def _adopt(self, path: Path, bid: str, move: bool) -> str:
        # A copy already cached is checked before it is trusted (size and hash): a damaged one would otherwise
        # fail every rebuild's push the same way. The file just derived replaces it.
        size = path.stat().st_size
        if not self.cache.has(bid) or self.cache.find_bad(bid, size) is not None:
            self.cache.add_file(bid, path, move=move)
        self.paths[bid] = self.cache.path(bid)
        self.sizes[bid] = self.cache.path(bid).stat().st_size
        return bid


def tensor_bytes(t: torch.Tensor) -> Any:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _pack_weights(weights: ModelWeights, blobs: _BlobWriter) -> dict[str, dict[str, Any]]:
    """One blob per decoder layer and one for the rest; returns each tensor's place and type."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights.tensors().items():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "head"
        groups.setdefault(key, {})[name] = t
    entries = {}
    for group in groups.values():
        names = list(group)
        bid, spans = blobs.add_packed([tensor_bytes(group[n]) for n in names])
        for name, (offset, nbytes) in zip(names, spans, strict=True):
            t = group[name]
            entries[name] = {
                "blob": bid,
                "offset": offset,
                "nbytes": nbytes,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
            }
    return dict(sorted(entries.items()))


def system_prompt_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """The tokens every chat request whose system message is ``text`` starts with.

    Rendered with two unlike user turns, the common start covers the system turn and the user turn's
    header, which is exactly what the template writes before any user text.
    """
    renders = [
        tokenizer.encode_chat([{"role": "system", "content": text}, {"role": "user", "content": user}])
        for user in ("Hello!", "7 + 5 = ?")
    ]
    common = 0
    for a, b in zip(*renders, strict=False):
        if a != b:
            break
        common += 1
    return renders[0][:common]


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
        tokens = system_prompt_tokens(tokenizer, text)
    if not tokens:
        raise BuildError(f"{flag} {spec.name}: {spec.path} gives no tokens")
    return tokens


def _engine(config: ModelConfig, weights: ModelWeights, options: BuildOptions, longest: int) -> LLMEngine:
    max_len = min(config.max_position_embeddings, longest + 1)
    if longest >= config.max_position_embeddings:
        raise BuildError(f"a prefix or adapter of {longest} tokens does not fit the model's context of "
                         f"{config.max_position_embeddings}")
    blocks = 2 * (-(-max_len // options.block_size)) + 2
    engine_options = EngineOptions(dtype=options.dtype, block_size=options.block_size, num_kv_blocks=blocks,
                                   max_num_seqs=1, max_model_len=max_len)
    return LLMEngine(Model(config, weights, max_len), None, engine_options)


def _kv_blobs(kv: torch.Tensor, blobs: _BlobWriter, world: int) -> dict[str, Any]:
    """KV in the pool layout as blob(s): one, or each tensor-parallel rank's KV heads in its own."""
    if world == 1:
        return {"blob": blobs.add_packed([tensor_bytes(kv)])[0], "shape": list(kv.shape)}
    shards = [shard_kv(kv, r, world) for r in range(world)]
    return {"blob": None, "rank_blobs": [blobs.add_packed([tensor_bytes(t)])[0] for t in shards],
            "shape": list(shards[0].shape)}


def _prefix_entry(spec: PrefixSpec, token_ids: list[int], engine: LLMEngine, blobs: _BlobWriter,
                  world: int) -> dict[str, Any]:
    hashes, kv = engine.prefix_kv(token_ids)
    entry: dict[str, Any] = {
        "name": spec.name,
        "kind": spec.kind,
        "token_ids": token_ids,
        "block_hashes": hashes,
        "blob": None,
        "dtype": str(kv.dtype).removeprefix("torch."),
        "shape": list(kv.shape),
    }
    if hashes:
        entry.update(_kv_blobs(kv, blobs, world))
    elif world > 1:
        entry["rank_blobs"] = [None] * world
    return entry


def _adapter_entry(
    adapter: PromptAdapter, engine: LLMEngine, blobs: _BlobWriter, log: Callable[[str], None], world: int
) -> dict[str, Any]:
    kv = compile_prompt_adapter(adapter, engine)
    bs = engine.blocks.block_size
    waste = wasted_slots(adapter.num_tokens, bs)
    log(f"adapter {adapter.name!r}: {adapter.kind}, {adapter.num_tokens} virtual tokens, {waste} of "
        f"{kv.shape[3] * bs} KV slots unused at block size {bs}"
        + ("" if not waste else f"; {alignment_advice(adapter.num_tokens, bs)}"))
    entry = {"name": adapter.name, "kind": adapter.kind, "num_virtual_tokens": adapter.num_tokens,
             "wasted_slots": waste, "base_model": adapter.base_model, "blob": None,
             "dtype": str(kv.dtype).removeprefix("torch."), "shape": list(kv.shape)}
    entry.update(_kv_blobs(kv, blobs, world))
    return entry


def _selector_entry(options: BuildOptions, tokenizer: Tokenizer | None, weights: ModelWeights, blobs: _BlobWriter,
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
    for e in options.adapter_examples:
        out[f"adapter-examples:{e.name}"] = file_blob_id(e.path)
    if options.lora is not None:
        out["lora"] = file_blob_id(options.lora / "adapter_model.safetensors")
    return dict(sorted(out.items()))
