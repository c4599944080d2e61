"""`warmstart verify`: hash the blobs of the local cache, remove the damaged ones and download them again.

Over one snapshot (the blobs it lists that are in the cache) or over the whole cache (every blob, and every
cached manifest). A damaged blob that a cached manifest lists is downloaded again from the store; one that
no cached manifest lists (a build's, or one rank's share of a sharded snapshot) is only removed: the next
build or pull brings it back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from warmstart.snapshot.cache import BadBlob, BlobCache
from warmstart.snapshot.errors import StoreError
from warmstart.snapshot.format import FormatError, Manifest
from warmstart.snapshot.progress import Progress, as_progress
from warmstart.snapshot.store import Store
from warmstart.snapshot.transfer import DEFAULT_CONCURRENCY, discard_damaged, pull_blobs


@dataclass
class VerifyReport:
    cache: str
    snapshot: str | None  # None: the whole cache
    blobs_checked: int = 0
    bytes_checked: int = 0
    blobs_missing: int = 0  # listed by the snapshot, not in the cache (not an error: `warmstart pull` fetches them)
    bad: list[dict[str, str]] = field(default_factory=list)  # {"blob", "problem", "action"}
    bad_manifests: list[str] = field(default_factory=list)  # cached manifests that did not match their id: removed
    failed: list[str] = field(default_factory=list)  # damaged blobs removed but not downloaded again: why
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"cache": self.cache, "snapshot": self.snapshot, "blobs_checked": self.blobs_checked,
                "bytes_checked": self.bytes_checked, "blobs_missing": self.blobs_missing, "bad": self.bad,
                "bad_manifests": self.bad_manifests, "seconds": round(self.seconds, 3)}


def verify_snapshot(cache: BlobCache, snapshot_id: str, manifest: bytes, store: Callable[[], Store], *,
                    concurrency: int = DEFAULT_CONCURRENCY, progress: bool | Progress | None = None) -> VerifyReport:
    """Hash the cached blobs of the snapshot; download the damaged ones again from ``store()`` (opened only
    when one is needed)."""
    started = time.monotonic()
    sizes = Manifest.decode(manifest, where=f"snapshot {snapshot_id}").blob_sizes()
    present = {b: size for b, size in sizes.items() if cache.has(b)}
    report = VerifyReport(str(cache.root), snapshot_id, blobs_missing=len(sizes) - len(present))
    bad = _check(cache, present, report, concurrency, progress)
    _download_again(cache, bad, {b.blob: (snapshot_id, sizes[b.blob]) for b in bad}, store, report, concurrency)
    report.seconds = time.monotonic() - started
    return report


def verify_cache(cache: BlobCache, store: Callable[[], Store], *, concurrency: int = DEFAULT_CONCURRENCY,
                 progress: bool | Progress | None = None) -> VerifyReport:
    """Hash every cached blob and check every cached manifest; remove what is damaged, and download again from
    ``store()`` the damaged blobs that a cached manifest lists."""
    started = time.monotonic()
    report = VerifyReport(str(cache.root), None)
    listed: dict[str, tuple[str, int]] = {}  # blob -> (a cached snapshot that lists it, its size)
    for sid in cache.snapshot_ids():
        raw = cache.get_manifest(sid)
        if raw is None:
            cache.remove_manifest(sid)
            report.bad_manifests.append(sid)
            continue
        try:
            sizes = Manifest.decode(raw, where=f"cached snapshot {sid}").blob_sizes()
        except (FormatError, KeyError, TypeError):
            continue  # another version's manifest: its blobs are still checked against their names
        listed.update({b: (sid, size) for b, size in sizes.items()})
    blobs = {b: listed[b][1] if b in listed else None for b in cache.blob_ids()}
    bad = _check(cache, blobs, report, concurrency, progress)
    _download_again(cache, bad, listed, store, report, concurrency)
    report.seconds = time.monotonic() - started
    return report


def _check(cache: BlobCache, sizes: Mapping[str, int | None], report: VerifyReport, concurrency: int,
           progress: bool | Progress | None) -> list[BadBlob]:
    reporter = as_progress(progress, "verify")
    reporter.start(sum(s or 0 for s in sizes.values()), len(sizes))
    try:
        bad = discard_damaged(cache, sizes, verify_hash=True, concurrency=concurrency, progress=reporter)
    finally:
        reporter.close()
    report.blobs_checked = len(sizes)
    report.bytes_checked = sum(s if s is not None else _size_of(cache, b) for b, s in sizes.items())
    return bad


def _size_of(cache: BlobCache, blob: str) -> int:
    try:
        return cache.path(blob).stat().st_size
    except FileNotFoundError:
        return 0


def _download_again(cache: BlobCache, bad: list[BadBlob], listed: dict[str, tuple[str, int]],
                    store: Callable[[], Store], report: VerifyReport, concurrency: int) -> None:
    """Fetch again every damaged blob that a snapshot lists (it was removed already); say what became of each."""
    opened: Store | None = None
    for b in bad:
        entry = {"blob": b.blob, "problem": b.problem}
        report.bad.append(entry)
        if b.blob not in listed:
            entry["action"] = "removed (no cached snapshot lists it: the next build or pull brings it back)"
            continue
        sid, size = listed[b.blob]
        try:
            opened = opened or store()
            pull_blobs(opened, cache, {b.blob: size}, concurrency=concurrency, snapshot=sid)
        except StoreError as e:
            entry["action"] = f"removed; downloading it again failed: {e}"
            report.failed.append(str(e))
            continue
        entry["action"] = f"downloaded again from {opened.uri}"
