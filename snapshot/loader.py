"""A snapshot back into a ready engine: pull what the cache lacks, map the blobs, register the prefix KV.

On the CPU, weights are views into private read-only mappings of the cached blobs: nothing is parsed or
copied, and resident memory grows only as pages are touched. On a GPU, each weight blob (one per decoder
layer) is copied from its mapping to the device through pinned staging buffers as soon as it is in the cache,
while later blobs are still being pulled (snapshot/device_copy.py), and the weights are the same views over
the device copies. Prefix KV is copied from its mapping into the engine's pool (one tensor per layer, on the
engine's device) and its blocks registered, pinned, in the prefix cache.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from warmstart import runtime
from warmstart.runtime import LLM
from warmstart.runtime.engine.adapters import AdapterSelector
from warmstart.runtime.engine.device import GIB, resolve_device
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.generation_config import GenerationDefaults
from warmstart.runtime.kernels import carry_kernels_under
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.weights import LayerWeights, ModelWeights
from warmstart.runtime.quant.formats import QuantizedWeight, from_tensors
from warmstart.runtime.timeline import Timeline
from warmstart.runtime.tokenizer import Tokenizer
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.device_copy import BlobCopier
from warmstart.snapshot.format import Manifest, blob_id, is_id, kv_fingerprint
from warmstart.snapshot.lora import LoraPull, lora_blob_ids, lora_loader
from warmstart.snapshot.manifest_view import DraftModel, ManifestView, TensorEntry
from warmstart.snapshot.refs import resolve_ref
from warmstart.snapshot.store import Store
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import pull_snapshot

if TYPE_CHECKING:
    from warmstart.runtime.engine.tensor_parallel import TensorParallelGroup


class SnapshotError(Exception):
    """A snapshot that cannot be loaded as asked; the message says why and what to do."""


@dataclass
class LoadReport:
    snapshot_id: str
    # manifest, blobs, device_copy (weights copied to a device), mapped, and the engine's own (kernels, graphs)
    timeline: Timeline = field(default_factory=lambda: Timeline(origin="load_start"))
    bytes_downloaded: int = 0
    blobs_downloaded: int = 0
    blobs_total: int = 0
    prefixes: list[dict[str, Any]] = field(default_factory=list)
    manifest: Manifest | None = None
    device: str = "cpu"
    device_copy: dict[str, Any] | None = None  # bytes, blobs, seconds, gb_per_s of the weights' copy, if any

    def rank_load(self, rank: int) -> dict[str, Any]:
        """This rank's cold start, as a tensor-parallel group gathers it: what it pulled, how long pulling
        and mapping took."""
        t = self.timeline
        return {"rank": rank, "bytes_downloaded": self.bytes_downloaded, "blobs_total": self.blobs_total,
                "pull_seconds": round(t.between("manifest", "blobs"), 4),
                "map_seconds": round(t.between("blobs", "mapped"), 4)}


def load(
    ref: str,
    store: str | Store | None = None,
    cache: str | Path | BlobCache | None = None,
    *,
    device: str | torch.device = "auto",
    **engine_options: Any,
) -> LLM:
    """The snapshot ``ref`` (an id, a unique id prefix or a ref name) as a ``runtime.LLM`` ready to serve on
    ``device`` (auto: CUDA when torch sees one, else the CPU; cpu, cuda or cuda:N)."""
    llm, _ = load_with_report(ref, store, cache, device=device, **engine_options)
    return llm


def load_with_report(
    ref: str,
    store: str | Store | None = None,
    cache: str | Path | BlobCache | None = None,
    *,
    concurrency: int = 8,
    group: TensorParallelGroup | None = None,
    device: str | torch.device = "auto",
    stage_weights: bool | None = None,
    **engine_options: Any,
) -> tuple[LLM, LoadReport]:
    """With ``group`` (a tensor-parallel rank), only this rank's blobs are pulled and mapped, and the engine runs
    this rank's shard (rank 0 leads; the caller runs ``runtime.tensor_parallel.follow`` on the others).

    ``device`` as for ``load``; one that does not exist here is refused before anything is pulled. Off the CPU
    the weights are copied to the device blob by blob as the blobs land in the cache (``stage_weights``: None
    copies when the device is not the CPU; True copies on the CPU too, through the same path, which is how it is
    tested without a GPU). The report's timeline has the load's phases, on time.monotonic()'s clock."""
    where = resolve_device(device)
    rank = None if group is None else group.rank
    blob_cache = cache if isinstance(cache, BlobCache) else BlobCache(Path(cache) if cache else None)
    raw = blob_cache.get_manifest(ref) if is_id(ref) else None
    cached = Manifest.decode(raw, where=f"cached snapshot {ref}") if raw is not None else None
    manifest = None
    the_store: Store | None = None  # opened only when something must be pulled
    copier = None
    if stage_weights or (stage_weights is None and where.type != "cpu"):
        copier = BlobCopier(where, lambda blob, size: _map_cached(blob_cache, blob, size, report.snapshot_id))
    draft = engine_options.get("speculative") == "draft"

    def check(m: Manifest) -> None:
        """Before anything is pulled: the rank count, and what the device can take."""
        _check_ranks(m, group)
        view = m.view(rank or 0)
        _check_runs_on(view, where, m.id)
        if copier is not None:
            copier.want(view.weight_blobs(with_draft=draft))
            _check_weights_fit(where, sum(copier.sizes.values()), m.id)

    if cached is not None:
        _check_ranks(cached, group)
    # A size check (a stat per blob) on every load; hashes are checked when blobs enter the cache, by `warmstart
    # pull` and by `warmstart verify`, not here: see "What is verified when" in docs/snapshots.md.
    report = LoadReport(ref, device=str(where))
    timeline = report.timeline

    try:
        if raw is not None and cached is not None and all(blob_cache.has(b, size)
                                                          for b, size in cached.blob_sizes(rank).items()):
            manifest = cached
            check(cached)  # everything is cached: a cold start needs no store at all
            timeline.mark("manifest", snapshot_id=report.snapshot_id)
        else:
            the_store = store if isinstance(store, Store) else open_store(store)
            report.snapshot_id = resolve_ref(the_store, ref)
            timeline.mark("manifest", snapshot_id=report.snapshot_id)
            raw, stats = pull_snapshot(the_store, blob_cache, report.snapshot_id, concurrency=concurrency, rank=rank,
                                       check=check, verify_cached=False,
                                       on_blob=copier.ready if copier is not None else None, defer=lora_blob_ids)
            report.bytes_downloaded, report.blobs_downloaded = stats.bytes_downloaded, stats.blobs_downloaded
        pulled_at = time.monotonic()
        if blob_id(raw) != report.snapshot_id:
            raise SnapshotError(f"snapshot {report.snapshot_id}: its manifest does not match its id (corrupt store "
                                "or cache); delete the cached manifest and pull again")
        manifest = manifest or Manifest.decode(raw, where=f"snapshot {report.snapshot_id}")
        report.manifest = manifest
        report.blobs_total = len(manifest.blob_ids(rank))
        timeline.mark("blobs", at=pulled_at, bytes_downloaded=report.bytes_downloaded,
                      blobs_downloaded=report.blobs_downloaded, blobs_total=report.blobs_total)
        _carry_kernels_in(blob_cache)
        lora_pull = None
        if the_store is not None and lora_blob_ids(manifest):  # left out of the pull above: pulled when first needed
            sizes = manifest.blob_sizes(rank)
            lora_pull = LoraPull(the_store, blob_cache, manifest.id, raw,
                                 {b: sizes[b] for b in lora_blob_ids(manifest)})
        engine = engine_from_manifest(manifest, blob_cache, engine_options, timeline, report.prefixes, group, copier,
                                      lora_pull.fetch if lora_pull is not None else lambda _: None)
    finally:
        if copier is not None:
            copier.stop()
    if copier is not None:
        report.device_copy = copier.stats.as_dict()
    timeline.take(engine.runner.timeline)
    return LLM(engine), report


def engine_from_manifest(
    manifest: Manifest,
    cache: BlobCache,
    engine_options: dict[str, Any],
    timeline: Timeline | None = None,
    prefixes_out: list[dict[str, Any]] | None = None,
    group: TensorParallelGroup | None = None,
    copier: BlobCopier | None = None,
    pull_lora: Callable[[str], None] = lambda _: None,
) -> LLMEngine:
    """``timeline`` gets the phases device_copy and mapped. ``copier``: the weight blobs' copy to the device, under
    way (see load_with_report); the engine's weights are views over its copies, and the engine runs where they are.
    ``pull_lora(blob)``: brings a LoRA adapter's blob into the cache when the engine first pages it in (a cold start
    leaves them in the store, see snapshot.lora.LoraPull)."""
    sid = manifest.id
    _check_ranks(manifest, group)
    m = manifest.view(0 if group is None else group.rank)
    config = ModelConfig.from_dict(dict(m.model_config), source=f"snapshot {sid}")
    options = _engine_options(m, engine_options, sid)
    on_device = _finish_copy(copier, sid) if copier is not None else {}
    timeline = timeline or Timeline()
    if copier is not None:
        timeline.mark("device_copy", device=str(copier.device), **copier.stats.as_dict())
    later = lora_blob_ids(manifest)  # read when an adapter is paged in, not mapped
    mapped = {b: on_device[b] if b in on_device else _map_cached(cache, b, size, sid)
              for b, size in m.blobs.items() if b not in later}
    tensors = {name: tensor_view(mapped[t.blob], t) for name, t in m.tensors.items()}
    shard_config = config
    if group is not None and group.world > 1:
        from warmstart.runtime.engine.tensor_parallel import shard_config as sharded

        shard_config = sharded(config, group.world)
    weights = _weights(shard_config, tensors, m.quantized)
    files = {name: cache.path(b) for name, b in m.tokenizer.items()}
    tokenizer = None
    if "tokenizer.json" in files:
        tokenizer = Tokenizer.from_files(
            files["tokenizer.json"], files.get("tokenizer_config.json"), files.get("chat_template.jinja")
        )
    timeline.mark("mapped")
    _check_fingerprint(m, sid)
    draft = _draft(m, mapped, sid) if options.speculative == "draft" else None
    if group is not None and group.world > 1:
        from warmstart.runtime.engine.tensor_parallel import rank_engine

        if options.speculative is not None:
            raise SnapshotError("speculative decoding does not combine with tensor parallelism yet")
        engine = rank_engine(config, weights, tokenizer, options, group, pinned_blocks=_pinned_blocks(m, options))
    else:
        engine = LLMEngine.from_weights(config, weights, tokenizer, options, draft,
                                        pinned_blocks=_pinned_blocks(m, options))
    engine.use_generation_defaults(GenerationDefaults.from_dict(dict(m.generation_config),
                                                                f"snapshot {sid}'s generation_config"))
    draft_kv = m.draft.prefix_kv if draft is not None and m.draft is not None else (None,) * len(m.prefixes)
    for p, d in zip(m.prefixes, draft_kv, strict=True):
        if p.kv is not None:
            engine.prefixes.load_prefix(p.token_ids, p.block_hashes, tensor_view(mapped[p.kv.blob], p.kv),
                                        tensor_view(mapped[d.blob], d) if d is not None else None)
        if prefixes_out is not None:
            prefixes_out.append({"name": p.name, "kind": p.kind, "tokens": len(p.token_ids),
                                 "cached_tokens": p.cached_tokens(options.block_size)})
    for a in m.adapters:
        engine.prefixes.load_adapter(a.name, a.kind, a.num_virtual_tokens, tensor_view(mapped[a.kv.blob], a.kv))
    for lora in m.loras:  # paged in by the engine when a request first needs one (snapshot/lora.py)
        engine.add_lora(lora.name, lora_loader(lora.record, cache, m.blobs[lora.blob], pull_lora), lora.rank)
    selector = m.adapter_selector
    if selector is not None:
        centroids = tensor_view(mapped[selector.centroids.blob], selector.centroids)
        engine.set_adapter_selector(AdapterSelector(list(selector.names), centroids))
    return engine


def _carry_kernels_in(cache: BlobCache) -> None:
    """Triton's compiled kernels go into the snapshot cache (kernels/<GPU architecture and versions>), which a
    volume or an image carries with the blobs, so a cold start loads them instead of compiling; only where the
    cache can be written (else warmstart's own directory, see runtime.kernels.carried_cache_dir)."""
    if os.access(cache.root, os.W_OK):
        carry_kernels_under(cache.root / "kernels")


def _check_runs_on(m: ManifestView, device: torch.device, sid: str) -> None:
    """nf4 has no GPU kernel (runtime/kernels/ops.py): refuse it off the CPU before anything is pulled."""
    if device.type == "cpu":
        return
    metas = list(m.quantized.values()) + list(m.draft.quantized.values() if m.draft is not None else [])
    if any(meta.get("scheme") == "nf4" for meta in metas):
        raise SnapshotError(f"snapshot {sid} is quantized nf4, which has no kernel on {device}; serve it on the CPU "
                            "(--device cpu), or rebuild it with --quant int8 or int4 for a GPU")


def _check_weights_fit(device: torch.device, nbytes: int, sid: str) -> None:
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise SnapshotError(f"snapshot {sid}'s weights are {nbytes / GIB:.2f} GiB, but {device} has {free / GIB:.2f} "
                            f"GiB free of {total / GIB:.2f} GiB; free GPU memory, use a larger GPU, quantize the "
                            "snapshot (--quant int8 or int4), or split it (--tensor-parallel N)")


def _finish_copy(copier: BlobCopier, sid: str) -> dict[str, torch.Tensor]:
    try:
        return copier.finish()
    except torch.cuda.OutOfMemoryError:
        raise SnapshotError(f"snapshot {sid}'s weights do not fit on {copier.device}: it ran out of memory while "
                            "they were copied there; free GPU memory, or quantize or split the snapshot") from None


def _pinned_blocks(m: ManifestView, options: EngineOptions) -> int:
    """KV blocks the snapshot's prefixes and adapters will hold for good (see LLMEngine.load_prefix and
    load_adapter), so that a pool sized from memory gets them on top of what requests need."""
    prefixes = sum(len(p.block_hashes) for p in m.prefixes if p.kv is not None)
    adapters = sum(a.blocks(options.block_size) for a in m.adapters)
    return (prefixes if options.enable_prefix_caching else 0) + adapters


def map_blob(path: Path) -> torch.Tensor:
    """A blob as a uint8 tensor over a private mapping: pages load on first touch, writes never reach the file."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _map_cached(cache: BlobCache, blob: str, size: int, sid: str) -> torch.Tensor:
    """The cached blob, mapped, refused unless it has the manifest's size (a damaged blob would otherwise fail
    later as a shape error deep in the engine)."""
    fix = f"run `warmstart verify {sid}` (it downloads it again) or `warmstart pull {sid}`"
    try:
        mapped = map_blob(cache.path(blob))
    except FileNotFoundError:
        raise SnapshotError(f"blob {blob} of snapshot {sid} is missing from the cache {cache.root}; {fix}") from None
    if mapped.numel() != size:
        raise SnapshotError(f"blob {blob} of snapshot {sid} in the cache {cache.root} is {mapped.numel():,} bytes, "
                            f"the manifest says {size:,}: it was damaged after it was pulled; {fix}")
    return mapped


def tensor_view(blob: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry`` places in ``blob`` (a mapped or copied blob's bytes), without a copy."""
    dtype = getattr(torch, entry.dtype)
    nbytes = entry.nbytes
    if nbytes is None:
        nbytes = torch.Size(entry.shape).numel() * torch.empty((), dtype=dtype).element_size()
    return blob[entry.offset : entry.offset + nbytes].view(dtype).view(entry.shape)


def _weights(config: ModelConfig, tensors: dict[str, torch.Tensor], quant_meta: Mapping[str, Any]) -> ModelWeights:
    def get(name: str) -> torch.Tensor | QuantizedWeight | None:
        if name in quant_meta:
            parts = {k[len(name) + 1 :]: t for k, t in tensors.items() if k.startswith(name + ".")}
            return from_tensors(dict(quant_meta[name]), parts)
        return tensors.get(name)

    layers = [
        LayerWeights(**{f.name: get(f"layers.{i}.{f.name}") for f in fields(LayerWeights)})  # type: ignore[arg-type]
        for i in range(config.num_layers)
    ]
    embed = tensors["embed"]
    lm_head = get("lm_head")
    return ModelWeights(embed=embed, layers=layers, norm=tensors["norm"], lm_head=embed if lm_head is None else lm_head)


def _engine_options(m: ManifestView, given: dict[str, Any], sid: str) -> EngineOptions:
    fixed = {"dtype": m.engine.dtype, "block_size": m.engine.block_size}
    for key, value in fixed.items():
        if given.get(key, value) != value:
            raise SnapshotError(
                f"snapshot {sid} was built with {key}={value!r}; it cannot run with {key}={given[key]!r} "
                f"(leave {key} unset, or rebuild with --{key.replace('_', '-')} {given[key]})"
            )
    unknown = sorted(set(given) - {f.name for f in fields(EngineOptions)})
    if unknown:
        raise SnapshotError(f"unknown engine option(s): {', '.join(unknown)}")
    return EngineOptions(**{**given, **fixed})


def _draft(m: ManifestView, mapped: dict[str, torch.Tensor], sid: str) -> tuple[ModelConfig, ModelWeights]:
    """The snapshot's draft model (see snapshot.draft), for speculative="draft"."""
    d: DraftModel | None = m.draft
    if d is None:
        raise SnapshotError(f"snapshot {sid} has no draft model; rebuild it with `warmstart build ... --draft "
                            "DRAFT_DIR`, or serve with --speculative ngram")
    config = ModelConfig.from_dict(dict(d.config), source=f"snapshot {sid} draft")
    tensors = {name: tensor_view(mapped[t.blob], t) for name, t in d.tensors.items()}
    weight_blobs = sorted({t.blob for t in d.tensors.values()})
    e = m.engine
    mine = kv_fingerprint(weight_blobs, dict(d.quantization), e.dtype, e.block_size, runtime.__version__)
    if d.prefix_kv and mine != d.fingerprint:
        raise SnapshotError(f"snapshot {sid}: its draft's prefix KV is not valid for warmstart {runtime.__version__}"
                            " with these weights; rebuild it with `warmstart build`")
    return config, _weights(config, tensors, d.quantized)


def _check_fingerprint(m: ManifestView, sid: str) -> None:
    weight_blobs = sorted({t.blob for t in m.tensors.values()})
    e = m.engine
    mine = kv_fingerprint(weight_blobs, dict(m.quantization), e.dtype, e.block_size, runtime.__version__)
    if (m.prefixes or m.adapters) and mine != m.fingerprint:
        raise SnapshotError(
            f"snapshot {sid}: its prefix and adapter KV was computed by warmstart {e.version} for other weights or "
            f"settings, and is not valid for warmstart {runtime.__version__} with these weights; rebuild it "
            "with `warmstart build`"
        )


def _check_ranks(manifest: Manifest, group: TensorParallelGroup | None) -> None:
    """A snapshot's weights are sharded for one rank count; refuse any other before anything is pulled."""
    world = 1 if group is None else group.world
    built = manifest.tensor_parallel
    if built != world:
        raise SnapshotError(
            f"snapshot {manifest.id} was built for tensor parallelism {built} and cannot run on {world} rank(s); "
            f"serve it with --tensor-parallel {built}, or rebuild it with `warmstart build MODEL_DIR "
            f"--tensor-parallel {world}`"
        )
