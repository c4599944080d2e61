"""LoRA adapters as their own blobs: built into a snapshot (`warmstart build --lora NAME=DIR`), pushed on their own
against a snapshot (`warmstart lora push`), and registered with the engine, which pages them in when a request
needs one (runtime/engine/lora.py).

Each adapter is the engine's fused layout (``LoraWeights.tensors()``) packed into one blob named by its content,
so snapshots that differ only by their adapters share every base blob, and adding an adapter uploads only it.
A manifest's "loras" list holds one entry per adapter:

    {"name", "rank", "meta" (LoraWeights.meta()), "blob", "tensors": {name: {offset, nbytes, dtype, shape}},
     "base_model" (PEFT's base_model_name_or_path, or None)}

A pushed adapter is the same entry in a small document (snapshot.format.encode_lora_document) stored as a blob,
which the store's ``loras/<snapshot id>.<name>`` pointer names; the pointer is written last, so a reader never
sees an adapter whose blobs are not all there.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.weights import DTYPES
from warmstart.snapshot.adapters import AdapterSpec, read_adapter_config, read_adapter_tensors
from warmstart.snapshot.build_parts import BlobWriter, tensor_bytes
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.errors import BuildError, CorruptBlob, NotFound, StoreError
from warmstart.snapshot.format import Manifest, blob_id, decode_lora_document, encode_lora_document
from warmstart.snapshot.refs import resolve_ref
from warmstart.snapshot.store import Store
from warmstart.snapshot.transfer import PushStats, pull_blobs, push_blobs

if TYPE_CHECKING:
    from warmstart.runtime.engine.lora import LoraWeights

FLAG = "--lora"
PUSH_RECHECKS = 3  # as snapshot.transfer: blobs that vanish before the pointer is written are uploaded again


class LoraError(Exception):
    """An adapter that cannot be fetched or loaded; the message says why and what to do."""


class LoraNotFound(LoraError):
    """No adapter of that name was pushed against the snapshot."""


def read_lora(spec: AdapterSpec, config: ModelConfig, dtype: torch.dtype, flag: str = FLAG) -> LoraWeights:
    """A PEFT LoRA directory in the engine's fused layout; BuildError naming ``flag`` and the adapter otherwise."""
    from warmstart.runtime.engine.lora import lora_from_peft

    what = f"{flag} {spec.name}"
    peft_config = read_adapter_config(spec.path, what)
    if peft_config["peft_type"] != "LORA":
        raise BuildError(f"{what}: {spec.path} is a {peft_config['peft_type']} adapter; {flag} takes LoRA adapters "
                         "(prompt-learning adapters go in with --adapter NAME=DIR)")
    tensors = read_adapter_tensors(spec.path, what)
    try:
        return lora_from_peft(spec.name, peft_config, tensors, config, dtype)
    except ValueError as e:
        raise BuildError(f"{what}: {e}") from None


def lora_entry(lora: LoraWeights, blobs: BlobWriter, base_model: str | None) -> dict[str, Any]:
    """Pack the adapter's tensors into one blob; returns its manifest entry (see the module docstring)."""
    tensors = lora.tensors()
    names = sorted(tensors)
    bid, spans = blobs.add_packed([tensor_bytes(tensors[n]) for n in names])
    places = {n: {"offset": offset, "nbytes": nbytes, "dtype": str(tensors[n].dtype).removeprefix("torch."),
                  "shape": list(tensors[n].shape)} for n, (offset, nbytes) in zip(names, spans, strict=True)}
    return {"name": lora.name, "rank": int(lora.rank), "meta": lora.meta(), "blob": bid, "tensors": places,
            "base_model": base_model}


def lora_blobs(entry: dict[str, Any], blobs: BlobWriter) -> dict[str, int]:
    return {entry["blob"]: blobs.sizes[entry["blob"]]}


def build_loras(specs: list[AdapterSpec], config: ModelConfig, dtype: torch.dtype, blobs: BlobWriter,
                log: Callable[[str], None], flag: str = FLAG) -> list[dict[str, Any]]:
    """The manifest's "loras" entries for ``--lora NAME=DIR`` adapters, each in its own blob."""
    entries = []
    for spec in specs:
        lora = read_lora(spec, config, dtype, flag)
        base_model = read_adapter_config(spec.path, f"{flag} {spec.name}").get("base_model_name_or_path")
        entries.append(lora_entry(lora, blobs, base_model if isinstance(base_model, str) else None))
        log(f"LoRA {spec.name!r}: rank {lora.rank}, {lora.nbytes():,} bytes in its own blob")
    return entries


# -- loading ---------------------------------------------------------------------------------------------------


def read_verified_blob(cache: BlobCache, blob: str, size: int, what: str) -> torch.Tensor:
    """The cached blob's bytes, refused unless they have the expected size and hash to the blob's id. An adapter is
    read when the engine first needs it (not at a cold start), and it is small, so it is hashed every time."""
    fix = "pull the snapshot again (`warmstart verify` replaces damaged blobs)"
    try:
        data = cache.path(blob).read_bytes()
    except FileNotFoundError:
        raise LoraError(f"{what}: blob {blob} is missing from the cache {cache.root}; {fix}") from None
    if len(data) != size:
        raise LoraError(f"{what}: blob {blob} in the cache {cache.root} is {len(data):,} bytes, {size:,} "
                        f"expected; {fix}")
    if blob_id(data) != blob:
        raise LoraError(f"{what}: blob {blob} in the cache {cache.root} does not hash to its id; {fix}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def lora_loader(entry: Mapping[str, Any], cache: BlobCache, size: int,
                pull: Callable[[str], None] = lambda _: None) -> Callable[[], LoraWeights]:
    """What the engine calls to page the adapter in: its blob read from the cache, verified, as LoraWeights.
    ``pull(blob)`` brings the blob into the cache first where it may not be there yet (LoraPull.fetch)."""
    from warmstart.runtime.engine.lora import LoraWeights

    name = entry["name"]

    def load() -> LoraWeights:
        check_record(entry, size, f"the record of LoRA adapter {name!r}")
        pull(entry["blob"])
        raw = read_verified_blob(cache, entry["blob"], size, f"LoRA adapter {name!r}")
        tensors = {n: _view(raw, place) for n, place in entry["tensors"].items()}
        return LoraWeights.from_tensors(name, entry["meta"], tensors)

    return load


STORED_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_record(entry: Any, blob_size: int, what: str) -> None:
    """LoraError naming what is wrong unless ``entry`` (a manifest's or a pushed document's record of one adapter)
    describes tensors that lie within its blob of ``blob_size`` bytes: the record is data from the store, and a
    tampered one must be refused, not crash the load."""
    def fail(why: str) -> LoraError:
        return LoraError(f"{what} {why}; push the adapter again")

    if not isinstance(entry, dict) or not isinstance(entry.get("tensors"), dict) or not entry["tensors"]:
        raise fail("has no table of tensors")
    if not isinstance(entry.get("meta"), dict) or not isinstance(entry.get("name"), str):
        raise fail("has no name or metadata")
    for name, place in entry["tensors"].items():
        if not isinstance(place, dict):
            raise fail(f"describes tensor {str(name)[:80]!r} as {type(place).__name__}, not an object")
        offset, nbytes, dtype, shape = (place.get(k) for k in ("offset", "nbytes", "dtype", "shape"))
        if dtype not in STORED_DTYPES:
            raise fail(f"gives tensor {str(name)[:80]!r} the dtype {str(dtype)[:20]!r}, not one of "
                       f"{', '.join(STORED_DTYPES)}")
        ints = [offset, nbytes, *(shape if isinstance(shape, list) else [None])]
        if not isinstance(shape, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                  for v in ints):
            raise fail(f"gives tensor {str(name)[:80]!r} an offset, size or shape that is not whole numbers")
        if nbytes != STORED_DTYPES[dtype] * math.prod(shape):
            raise fail(f"gives tensor {str(name)[:80]!r} {nbytes} bytes, which its shape {shape} of {dtype} is not")
        if offset + nbytes > blob_size:
            raise fail(f"places tensor {str(name)[:80]!r} past the end of its {blob_size}-byte blob")


def _view(raw: torch.Tensor, place: dict[str, Any]) -> torch.Tensor:
    start = place["offset"]
    return raw[start : start + place["nbytes"]].view(getattr(torch, place["dtype"])).view(place["shape"])


def lora_blob_ids(manifest: Manifest) -> set[str]:
    """The blobs of a manifest's LoRA adapters: not needed to serve until a request names one."""
    return {lora.blob for lora in manifest.view().loras}


class LoraPull:
    """A cold start's LoRA blobs, left in the store until the engine first pages each adapter in (``fetch``): a
    snapshot with many adapters starts and serves its first requests as fast as one without them, and the first
    request for an adapter waits for its one blob. Measured (benchmarks/cold_start.py --loras 8 on the 2-core
    machine, S3 on a moto server): pulling them in a thread, even after the engine was ready and at nice 19, cost
    the start a median +1.2 s. Once every adapter's blob is in, the manifest is cached, keeping the cache's rule
    that a cached manifest's blobs are all there (`warmstart pull` brings them all at once)."""

    def __init__(self, store: Store, cache: BlobCache, snapshot_id: str, manifest_bytes: bytes,
                 sizes: dict[str, int]) -> None:
        self.store, self.cache, self.snapshot_id, self.manifest_bytes = store, cache, snapshot_id, manifest_bytes
        self.sizes = sizes
        self._lock = threading.Lock()

    def fetch(self, blob: str) -> None:
        """Bring the blob into the cache (verified), unless it is there."""
        with self._lock:
            try:
                pull_blobs(self.store, self.cache, {blob: self.sizes[blob]}, snapshot=self.snapshot_id,
                           verify_cached=False)
            except StoreError as e:
                raise LoraError(f"a LoRA adapter's blob could not be pulled from {self.store.uri}: {e}") from None
            if all(self.cache.has(b, n) for b, n in self.sizes.items()):
                self.cache.add_manifest(self.snapshot_id, self.manifest_bytes)


# -- pushing one adapter against a snapshot in a store -----------------------------------------------------------


def base_manifest(store: Store, ref: str) -> Manifest:
    snapshot_id = resolve_ref(store, ref)
    manifest = Manifest.decode(store.get_manifest(snapshot_id), where=f"snapshot {snapshot_id} in {store.uri}")
    if manifest.tensor_parallel > 1:
        raise BuildError(f"snapshot {snapshot_id} is sharded for tensor parallelism {manifest.tensor_parallel}; "
                         "LoRA adapters are served on one rank only")
    return manifest


def push_lora(store: Store, cache: BlobCache, spec: AdapterSpec, ref: str,
              log: Callable[[str], None] = lambda _: None) -> tuple[str, str, PushStats]:
    """Convert the PEFT adapter for snapshot ``ref``'s model, upload its blob and document (only what the store
    lacks), check they are there, then point ``loras/<id>.<name>`` at the document. Returns (snapshot id, document
    id, what was uploaded)."""
    manifest = base_manifest(store, ref)
    data = manifest.data
    config = ModelConfig.from_dict(data["model"]["config"], source=f"snapshot {manifest.id}")
    blobs = BlobWriter(cache)
    entry = build_loras([spec], config, DTYPES[data["engine"]["dtype"]], blobs, log, "lora push")[0]
    document, _ = blobs.add_packed([encode_lora_document(manifest.id, entry, lora_blobs(entry, blobs))])
    paths = dict(blobs.paths)
    stats = push_blobs(store, paths)
    for _ in range(PUSH_RECHECKS):
        gone = [b for b, p in paths.items() if not store.has_blob(b, p.stat().st_size)]
        if not gone:
            store.set_lora(manifest.id, spec.name, document)
            return manifest.id, document, stats
        stats += push_blobs(store, {b: paths[b] for b in gone})
    raise StoreError(f"blobs of LoRA adapter {spec.name!r} keep vanishing from {store.uri} while it is pushed; is a "
                     "`warmstart gc` with a short --grace-seconds running? Push again when it is done")


def fetch_lora(store: Store, cache: BlobCache, snapshot_id: str, name: str) -> tuple[dict[str, Any], int]:
    """Adapter ``name`` pushed against the snapshot: its document and blobs brought into the cache, each verified
    against its id. Returns its entry and its blob's size. LoraError (NotFound's message) when there is none."""
    try:
        document = store.get_lora(snapshot_id, name)
        pull_blobs(store, cache, {document: store.blob_size(document)}, snapshot=snapshot_id)
    except NotFound as e:
        raise LoraNotFound(str(e)) from None
    where = f"the document of LoRA adapter {name!r} of snapshot {snapshot_id} in {store.uri}"
    data = decode_lora_document(cache.path(document).read_bytes(), where)
    entry = data["lora"]
    if data["snapshot"] != snapshot_id:
        raise CorruptBlob(f"{where} was pushed against snapshot {data['snapshot']}; push it again")
    if set(data["blobs"]) != {entry.get("blob")}:
        raise CorruptBlob(f"{where} lists blobs other than its adapter's; push it again")
    check_record(entry, data["blobs"][entry["blob"]], where)
    pull_blobs(store, cache, data["blobs"], snapshot=snapshot_id)
    return entry, data["blobs"][entry["blob"]]


class LoraSource:
    """Where a server fetches adapters by name while it serves: the store it loaded its snapshot from."""

    def __init__(self, store: Store | str | None, cache: BlobCache, snapshot_id: str) -> None:
        self._store, self.cache, self.snapshot_id = store, cache, snapshot_id

    def store(self) -> Store:
        if not isinstance(self._store, Store):
            from warmstart.snapshot.stores import open_store

            self._store = open_store(self._store)
        return self._store

    def fetch(self, name: str) -> tuple[dict[str, Any], Callable[[], LoraWeights]]:
        entry, size = fetch_lora(self.store(), self.cache, self.snapshot_id, name)
        return entry, lora_loader(entry, self.cache, size)

