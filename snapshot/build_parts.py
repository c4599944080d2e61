"""What building a snapshot's model and its draft model share (snapshot/build.py, snapshot/draft.py): the
build options, the blob writer, weights packed into blobs, and the engine that computes prefix KV."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import AUTO, EngineOptions
from warmstart.runtime.engine.tensor_parallel import TensorParallelError, check_shardable, shard_kv
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.model import Model
from warmstart.runtime.models.weights import DTYPES, ModelWeights
from warmstart.runtime.quant.quantize import SCHEMES
from warmstart.snapshot.adapters import AdapterSpec
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.errors import BuildError
from warmstart.snapshot.format import file_blob_id, write_packed

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
    group_size: int | None = None  # None: the largest that fits every layer (runtime.quant.formats decides)
    dtype: str = "auto"  # stores bfloat16, which every CPU kind serves (runtime/engine/dtype_choice.py)
    block_size: int = EngineOptions.block_size
    prefixes: list[PrefixSpec] = field(default_factory=list)
    adapters: list[AdapterSpec] = field(default_factory=list)  # PEFT prompt-learning adapters
    adapter_examples: list[AdapterSpec] = field(default_factory=list)  # example queries per adapter, for "auto"
    lora: Path | None = None  # a LoRA adapter merged into the weights (--lora-merge)
    loras: list[AdapterSpec] = field(default_factory=list)  # LoRA adapters served unmerged, each its own blob
    draft: Path | None = None  # a draft model's HF directory, for speculative decoding (snapshot.draft)
    draft_quant: str = "none"
    draft_group_size: int | None = None
    tensor_parallel: int = 1  # ranks the weights and KV are sharded for (runtime/engine/tensor_parallel.py)

    def validate(self) -> None:
        if self.quant not in SCHEMES:
            raise BuildError(f"--quant must be one of {', '.join(SCHEMES)}, got {self.quant!r}")
        if self.draft_quant not in SCHEMES:
            raise BuildError(f"--draft-quant must be one of {', '.join(SCHEMES)}, got {self.draft_quant!r}")
        if self.dtype not in (AUTO, *DTYPES):
            raise BuildError(f"--dtype must be one of {AUTO}, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise BuildError(f"--block-size must be >= 1, got {self.block_size}")
        if self.tensor_parallel < 1:
            raise BuildError(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.loras:
            raise BuildError("--lora NAME=DIR does not combine with --tensor-parallel yet; merge the adapter with "
                             "--lora-merge DIR, or build without --tensor-parallel")
        if self.tensor_parallel > 1 and self.draft is not None:
            raise BuildError("--draft does not combine with --tensor-parallel yet; build without one of them")
        try:
            check_shardable(self.quant, self.tensor_parallel)
        except TensorParallelError as e:
            raise BuildError(str(e)) from None
        names = [p.name for p in self.prefixes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise BuildError(f"prefix name(s) given twice: {', '.join(dupes)}")
        adapters = [a.name for a in self.adapters]
        for flag, given in (("--adapter", adapters), ("--adapter-examples", [e.name for e in self.adapter_examples])):
            dupes = sorted({n for n in given if given.count(n) > 1})
            if dupes:
                raise BuildError(f"{flag}: name(s) given twice: {', '.join(dupes)}")
        loras = [a.name for a in self.loras]
        dupes = sorted({n for n in loras if loras.count(n) > 1})
        if dupes:
            raise BuildError(f"--lora: name(s) given twice: {', '.join(dupes)}")
        both = sorted(set(loras) & set(adapters))
        if both:
            raise BuildError(f"{', '.join(both)}: named by both --lora and --adapter; requests pick an adapter by "
                             "name, so give each its own")
        unknown = sorted({e.name for e in self.adapter_examples} - set(adapters))
        if unknown:
            raise BuildError(f"--adapter-examples for {', '.join(unknown)}, which no --adapter names")
        if self.adapter_examples and len(self.adapter_examples) != len(self.adapters):
            missing = sorted(set(adapters) - {e.name for e in self.adapter_examples})
            raise BuildError(f"--adapter-examples: the 'auto' selector needs examples for every adapter; "
                             f"missing for {', '.join(missing)}")


class BlobWriter:
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


def pack_weights(weights: ModelWeights, blobs: BlobWriter) -> dict[str, dict[str, Any]]:
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


def prefix_engine(config: ModelConfig, weights: ModelWeights, options: BuildOptions, longest: int) -> LLMEngine:
    max_len = min(config.max_position_embeddings, longest + 1)
    if longest >= config.max_position_embeddings:
        raise BuildError(f"a prefix or adapter of {longest} tokens does not fit the model's context of "
                         f"{config.max_position_embeddings}")
    blocks = 2 * (-(-max_len // options.block_size)) + 2
    engine_options = EngineOptions(dtype=options.dtype, block_size=options.block_size, num_kv_blocks=blocks,
                                   max_num_seqs=1, max_model_len=max_len)
    return LLMEngine(Model(config, weights, max_len), None, engine_options)


def kv_blobs(kv: torch.Tensor, blobs: BlobWriter, world: int) -> dict[str, Any]:
    """KV in the pool layout as blob(s): one, or each tensor-parallel rank's KV heads in its own."""
    if world == 1:
        return {"blob": blobs.add_packed([tensor_bytes(kv)])[0], "shape": list(kv.shape)}
    shards = [shard_kv(kv, r, world) for r in range(world)]
    return {"blob": None, "rank_blobs": [blobs.add_packed([tensor_bytes(t)])[0] for t in shards],
            "shape": list(shards[0].shape)}


def prefix_entry(spec: PrefixSpec, token_ids: list[int], engine: LLMEngine, blobs: BlobWriter,
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
        entry.update(kv_blobs(kv, blobs, world))
    elif world > 1:
        entry["rank_blobs"] = [None] * world
    return entry
