"""The snapshot format: content-hashed blobs and a msgpack manifest whose hash is the snapshot id.

No torch here, so a store can be listed, pulled and garbage-collected without loading a model.
docs/SNAPSHOT_FORMAT.md is the specification; this module is its reader and writer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from warmstart.snapshot.manifest_view import ManifestView

FORMAT = "warmstart-snapshot"
FORMAT_VERSION = 1
ALIGNMENT = 4096  # every tensor starts at a multiple of this inside its blob
ID_LENGTH = 32  # hex digits of an xxh3-128 digest
_CHUNK = 1 << 20


class FormatError(Exception):
    """A manifest that this version cannot read; the message says what is wrong."""


def blob_id(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def file_blob_id(path: str | os.PathLike[str]) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def is_id(text: str) -> bool:
    return len(text) == ID_LENGTH and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class Manifest:
    """A decoded manifest. ``data`` is the msgpack map itself (see docs/SNAPSHOT_FORMAT.md), what the build writes
    and the id hashes; ``view(rank)`` reads it as typed records."""

    data: dict[str, Any]

    def encode(self) -> bytes:
        return bytes(msgpack.packb(self.data, use_bin_type=True))

    @property
    def id(self) -> str:
        return blob_id(self.encode())

    @classmethod
    def decode(cls, raw: bytes, where: str = "manifest") -> Manifest:
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as e:
            raise FormatError(f"{where} is not a valid msgpack manifest ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise FormatError(f"{where} is not a warmstart snapshot manifest")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatError(
                f"{where} has format version {version}; this warmstart reads version {FORMAT_VERSION} "
                "(rebuild the snapshot with this version, or upgrade warmstart)"
            )
        return cls(data)

    def view(self, rank: int = 0) -> ManifestView:
        """What tensor-parallel rank ``rank`` reads (the whole manifest when it is not sharded), typed."""
        return ManifestView(rank_view(self.data, rank))

    def blob_sizes(self, rank: int | None = None) -> dict[str, int]:
        """Every blob the snapshot needs, with its size in bytes; with ``rank``, only those that tensor-parallel
        rank needs (all of them when the snapshot is not sharded)."""
        return dict((self.data if rank is None else rank_view(self.data, rank))["blobs"])

    def blob_ids(self, rank: int | None = None) -> set[str]:
        return set(self.blob_sizes(rank))

    @property
    def tensor_parallel(self) -> int:
        """How many ranks the weights are sharded for (1: not sharded)."""
        return tensor_parallel_size(self.data)


def tensor_parallel_size(data: dict[str, Any]) -> int:
    return int((data.get("tensor_parallel") or {}).get("size", 1))


def rank_view(data: dict[str, Any], rank: int) -> dict[str, Any]:
    """A sharded manifest as rank ``rank`` reads it: its own tensors, fingerprint, blobs and prefix and adapter
    KV blobs in the places an unsharded manifest has them. An unsharded manifest is its own view."""
    tp = data.get("tensor_parallel")
    if not tp:
        return data
    if not 0 <= rank < len(tp["ranks"]):
        raise FormatError(f"the snapshot is sharded for {len(tp['ranks'])} ranks; there is no rank {rank}")
    mine = tp["ranks"][rank]
    return {
        **data,
        "tensors": mine["tensors"],
        "quantized": mine["quantized"],
        "fingerprint": mine["fingerprint"],
        "blobs": {b: data["blobs"][b] for b in mine["blobs"]},
        "prefixes": [{**p, "blob": p["rank_blobs"][rank]} for p in data["prefixes"]],
        "adapters": [{**a, "blob": a["rank_blobs"][rank]} for a in data.get("adapters", [])],
    }


def kv_fingerprint(weight_blobs: list[str], quantization: dict[str, Any], dtype: str, block_size: int,
                   engine_version: str) -> str:
    """What precomputed KV depends on: the exact weights (their blobs' content hashes), how they are run,
    and the engine version that ran them. A loader whose own fingerprint differs must refuse the KV."""
    key = {"weights": sorted(weight_blobs), "quantization": quantization, "dtype": dtype,
           "block_size": block_size, "engine": engine_version}
    return blob_id(bytes(msgpack.packb(key, use_bin_type=True)))


def aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def write_packed(path: Path, parts: list[Any]) -> list[tuple[int, int]]:
    """Write ``parts`` (buffers) into one file, each at an aligned offset; returns (offset, nbytes) per part."""
    spans = []
    offset = 0
    with open(path, "wb") as f:
        for part in parts:
            start = aligned(offset)
            if start > offset:
                f.write(b"\0" * (start - offset))
            f.write(part)
            n = memoryview(part).nbytes
            spans.append((start, n))
            offset = start + n
    return spans


# LoRA adapters pushed on their own against a snapshot (`warmstart lora push`, snapshot/lora.py): a small msgpack
# document stored as a blob, which a store's loras/<snapshot id>.<name> pointer names.
LORA_FORMAT = "warmstart-lora"


def encode_lora_document(snapshot_id: str, entry: dict[str, Any], blobs: dict[str, int]) -> bytes:
    """``entry``: the adapter as a manifest's "loras" list holds it; ``blobs``: its blobs and their sizes."""
    data = {"format": LORA_FORMAT, "format_version": FORMAT_VERSION, "snapshot": snapshot_id, "lora": entry,
            "blobs": dict(sorted(blobs.items()))}
    return bytes(msgpack.packb(data, use_bin_type=True))


def decode_lora_document(raw: bytes, where: str) -> dict[str, Any]:
    """A LoRA document's map; FormatError naming ``where`` when it is not one this version reads."""
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:
        raise FormatError(f"{where} is not a valid msgpack document ({e})") from None
    if not isinstance(data, dict) or data.get("format") != LORA_FORMAT:
        raise FormatError(f"{where} is not a warmstart LoRA adapter document")
    if data.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{where} has format version {data.get('format_version')}; this warmstart reads version "
                          f"{FORMAT_VERSION} (push the adapter again with this version)")
    blobs = data.get("blobs")
    if not isinstance(blobs, dict) or not isinstance(data.get("lora"), dict) or not all(
            is_id(b) and isinstance(n, int) and n >= 0 for b, n in blobs.items()):
        raise FormatError(f"{where} has no valid adapter or blob list; push the adapter again")
    return data
