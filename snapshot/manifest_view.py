"""A manifest read as typed records: what each key of docs/SNAPSHOT_FORMAT.md holds, named once.

``Manifest`` (snapshot/format.py) keeps the msgpack map itself, whose bytes are the snapshot's id, and the build
writes that map; readers take ``Manifest.view(rank)``, one tensor-parallel rank's ManifestView (an unsharded
snapshot's is the whole), and read attributes instead of string keys. No torch here: listing and pulling read
manifests too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class TensorEntry:
    """A tensor's bytes: ``blob[offset : offset + nbytes]``, C-contiguous, little-endian, of ``dtype`` (torch's name)
    and ``shape``. Prefix, adapter and selector records carry the same fields for their one tensor."""

    blob: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int | None = None  # absent in the records that hold one whole blob

    @classmethod
    def read(cls, raw: Mapping[str, Any]) -> TensorEntry:
        return cls(raw["blob"], raw["dtype"], tuple(raw["shape"]), int(raw.get("offset", 0)), raw.get("nbytes"))


@dataclass(frozen=True)
class EngineSettings:
    """What the KV and weights were made for: the dtype, the KV block size, the warmstart that built them."""

    dtype: str
    block_size: int
    version: str


@dataclass(frozen=True)
class PrefixEntry:
    """A prefix whose KV the build computed: ``kv`` holds its full blocks (None when shorter than one block)."""

    name: str
    kind: str  # "text" or "system"
    token_ids: list[int]
    block_hashes: list[int]  # the prefix-cache keys of its full blocks
    kv: TensorEntry | None

    def cached_tokens(self, block_size: int) -> int:
        return len(self.block_hashes) * block_size


@dataclass(frozen=True)
class AdapterEntry:
    """A compiled prompt-learning adapter: the KV of its virtual tokens, in whole blocks."""

    name: str
    kind: str  # PROMPT_TUNING, P_TUNING or PREFIX_TUNING
    num_virtual_tokens: int
    wasted_slots: int
    base_model: str | None
    kv: TensorEntry

    def blocks(self, block_size: int) -> int:
        return -(-self.num_virtual_tokens // block_size)


@dataclass(frozen=True)
class LoraEntry:
    """A LoRA adapter served unmerged, in a blob of its own. ``record`` is the map as stored: snapshot/lora.py checks
    it before it reads the tensors it places, as it checks a pushed adapter's."""

    name: str
    rank: int
    blob: str
    base_model: str | None
    record: Mapping[str, Any]


@dataclass(frozen=True)
class SelectorEntry:
    """The "auto" adapter selector: one centroid per adapter, and how well it routed held-out examples."""

    names: tuple[str, ...]
    held_out: int
    accuracy: float | None
    centroids: TensorEntry


@dataclass(frozen=True)
class DraftModel:
    """The draft model of speculative decoding, with its own weights and the KV of the prefixes under it."""

    architecture: str
    config: Mapping[str, Any]  # its HF config.json
    tensors: Mapping[str, TensorEntry]
    quantized: Mapping[str, Mapping[str, Any]]
    quantization: Mapping[str, Any]
    fingerprint: str
    prefix_kv: tuple[TensorEntry | None, ...]  # one per prefix of the snapshot, in their order


def _tensors(raw: Mapping[str, Any]) -> dict[str, TensorEntry]:
    return {name: TensorEntry.read(t) for name, t in raw.items()}


class ManifestView:
    """One rank's view of a decoded manifest (see snapshot.format.rank_view), as typed records."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data

    @property
    def architecture(self) -> str:
        return str(self.data["model"]["architecture"])

    @property
    def model_config(self) -> Mapping[str, Any]:
        """The model's HF config.json, verbatim."""
        return self.data["model"]["config"]  # type: ignore[no-any-return]

    @cached_property
    def engine(self) -> EngineSettings:
        e = self.data["engine"]
        return EngineSettings(e["dtype"], int(e["block_size"]), e["version"])

    @property
    def quantization(self) -> Mapping[str, Any]:
        """``scheme`` (none, int8, int4, nf4) and ``group_size``."""
        return self.data["quantization"]  # type: ignore[no-any-return]

    @cached_property
    def tensors(self) -> dict[str, TensorEntry]:
        return _tensors(self.data["tensors"])

    @property
    def quantized(self) -> Mapping[str, Mapping[str, Any]]:
        """Each quantized weight's scheme metadata, for runtime.quant.from_tensors."""
        return self.data.get("quantized", {})  # type: ignore[no-any-return]

    @property
    def tokenizer(self) -> Mapping[str, str]:
        """File name (tokenizer.json, tokenizer_config.json, chat_template.jinja) -> blob id."""
        return self.data["tokenizer"]  # type: ignore[no-any-return]

    @property
    def fingerprint(self) -> str:
        return str(self.data["fingerprint"])

    @property
    def generation_config(self) -> Mapping[str, Any]:
        return self.data.get("generation_config") or {}

    @property
    def provenance(self) -> Mapping[str, Any]:
        """``tool`` (the warmstart that built it), ``torch``, ``sources`` and ``options``."""
        return self.data["provenance"]  # type: ignore[no-any-return]

    @property
    def blobs(self) -> Mapping[str, int]:
        """Blob id -> size in bytes, for every blob this view needs."""
        return self.data["blobs"]  # type: ignore[no-any-return]

    @cached_property
    def prefixes(self) -> list[PrefixEntry]:
        return [PrefixEntry(p["name"], p["kind"], list(p["token_ids"]), list(p["block_hashes"]),
                            TensorEntry.read(p) if p["blob"] is not None else None) for p in self.data["prefixes"]]

    @cached_property
    def adapters(self) -> list[AdapterEntry]:
        return [AdapterEntry(a["name"], a["kind"], int(a["num_virtual_tokens"]), int(a["wasted_slots"]),
                             a.get("base_model"), TensorEntry.read(a)) for a in self.data.get("adapters", [])]

    @cached_property
    def loras(self) -> list[LoraEntry]:
        return [LoraEntry(a["name"], int(a["rank"]), a["blob"], a.get("base_model"), a)
                for a in self.data.get("loras", [])]

    @cached_property
    def adapter_selector(self) -> SelectorEntry | None:
        s = self.data.get("adapter_selector")
        if s is None:
            return None
        return SelectorEntry(tuple(s["names"]), int(s["held_out"]), s["accuracy"], TensorEntry.read(s))

    @cached_property
    def draft(self) -> DraftModel | None:
        d = self.data.get("draft")
        if not d:
            return None
        kv = tuple(None if k is None else TensorEntry.read(k) for k in d["prefix_kv"])
        return DraftModel(d["model"]["architecture"], d["model"]["config"], _tensors(d["tensors"]),
                          d.get("quantized", {}), d["quantization"], d["fingerprint"], kv)

    def weight_blobs(self, with_draft: bool = False) -> dict[str, int]:
        """The blobs holding the weights (and the draft model's, ``with_draft``), with their sizes."""
        entries = list(self.tensors.values())
        if with_draft and self.draft is not None:
            entries += self.draft.tensors.values()
        return {t.blob: self.blobs[t.blob] for t in entries}
