"""Deleting the blobs of a store that no snapshot references, and the temporary files killed writers left."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from warmstart.snapshot.errors import NotFound, StoreError
from warmstart.snapshot.format import FormatError, Manifest, blob_id, decode_lora_document
from warmstart.snapshot.store import Store
from warmstart.snapshot.temporaries import Removed, remove_cache_temporaries, remove_store_temporaries


@dataclass(frozen=True)
class GcReport:
    blobs_deleted: int  # or that would be deleted, in a dry run
    bytes_freed: int
    kept: int  # blobs left: referenced, or unreferenced but younger than the grace period
    kept_in_grace: int  # the unreferenced ones among them
    temporaries_deleted: int = 0  # stale temporary files (and staging directories) of killed writers
    temporary_bytes_freed: int = 0


def gc(store: Store, *, dry_run: bool = False, grace_seconds: float = 3600, cache_root: Path | None = None) -> GcReport:
    """Delete the store's blobs that no manifest references.

    A push uploads its blobs before its manifest, so while a push is in flight its new blobs are referenced
    by nothing yet: blobs younger than ``grace_seconds`` are kept for that reason. A push that reuses an old
    unreferenced blob (left by a crashed push) refreshes its age first, and each blob's age is read again just
    before it is deleted, so such a blob is kept too (see Store.delete_blob_if_older). Do not gc while pushing
    with a grace period shorter than pushes take.

    Temporary files that killed writers left in a local store, and in the cache at ``cache_root`` when given,
    are removed too once nothing has written to them for the grace period (see snapshot.temporaries).
    """
    blobs = list(store.list_blobs())  # before the manifests: a manifest written meanwhile is then seen
    referenced: set[str] = set()
    for snapshot_id in store.list_snapshots():
        raw = store.get_manifest(snapshot_id)
        try:
            referenced |= Manifest.decode(raw, where=f"snapshot {snapshot_id}").blob_ids()
        except (FormatError, KeyError, TypeError) as e:
            raise StoreError(f"gc stopped, deleting nothing: the manifest of snapshot {snapshot_id} in {store.uri} "
                             f"cannot be read ({e}), so the blobs it needs are unknown") from None
    referenced |= _lora_blobs(store)
    now = time.time()
    deleted = freed = in_grace = 0
    for blob, size, modified in blobs:
        if blob in referenced:
            continue
        if now - modified < grace_seconds:
            in_grace += 1
            continue
        if not dry_run and not store.delete_blob_if_older(blob, now - grace_seconds):
            in_grace += 1  # refreshed since the listing by a push that relies on it (or gone already)
            continue
        deleted += 1
        freed += size
    temporaries = _remove_temporaries(store, cache_root, now - grace_seconds, dry_run)
    return GcReport(deleted, freed, len(blobs) - deleted, in_grace, temporaries.count, temporaries.bytes)


def _lora_blobs(store: Store) -> set[str]:
    """The blobs of the LoRA adapters pushed against snapshots (`warmstart lora push`): their documents and what
    those list. A pointer whose document is gone keeps nothing; one whose document cannot be read stops gc."""
    out: set[str] = set()
    for (snapshot_id, name), document in store.list_loras().items():
        out.add(document)
        try:
            raw = store.read_range(document, 0, store.blob_size(document))
        except NotFound:
            continue
        where = f"the document of LoRA adapter {name!r} of snapshot {snapshot_id} in {store.uri}"
        try:
            if blob_id(raw) != document:
                raise FormatError("its bytes do not match its id")
            out |= set(decode_lora_document(raw, where)["blobs"])
        except FormatError as e:
            raise StoreError(f"gc stopped, deleting nothing: {where} cannot be read ({e}), so the blobs it needs are "
                             "unknown; push the adapter again") from None
    return out


def _remove_temporaries(store: Store, cache_root: Path | None, cutoff: float, dry_run: bool) -> Removed:
    removed = remove_store_temporaries(store, cutoff, dry_run=dry_run)
    if cache_root is not None:
        cached = remove_cache_temporaries(cache_root, cutoff, dry_run=dry_run)
        removed = Removed(removed.count + cached.count, removed.bytes + cached.bytes)
    return removed
