"""The local blob cache, and moving snapshots between it and a store: push, pull, resolve a ref, gc.

Cache layout (under $WARMSTART_CACHE or ~/.cache/warmstart/cache):

    blobs/<id>                  verified blobs, ready to map
    snapshots/<id>.msgpack      manifests of snapshots whose blobs are all here
    locks/<id>                  one lock file per blob while some process is downloading it
    tmp/                        blobs being downloaded (one file per blob, named by its id)

A blob enters ``blobs/`` only by a rename after its bytes were verified against its name, so whatever is
there is whole and correct, whichever process put it there.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from snapshot.format import FormatError, Manifest, blob_id, file_blob_id, is_id
from snapshot.store import (
    CHUNK,
    CorruptBlob,
    NoSuchBucket,
    NotFound,
    Store,
    StoreError,
    TransferInterrupted,
    check_id,
    copy_into,
    fsync_dir,
    is_ref_name,
    os_errors,
    user_cache_dir,
    write_all,
    write_atomic,
)

log = logging.getLogger("warmstart.snapshot")

DEFAULT_CONCURRENCY = 8
DEFAULT_PART_SIZE = 16 << 20
PUSH_CONCURRENCY = 4
RETRIES = 5  # per part, for connections dropped while the body streams (botocore retries whole requests)
BACKOFF_SECONDS = 0.2
MIN_PREFIX = 4  # shortest id prefix that resolve_ref accepts


def default_cache_dir() -> Path:
    return Path(os.environ.get("WARMSTART_CACHE") or user_cache_dir() / "cache").expanduser()


class BlobCache:
    """Verified blobs and manifests on local disk."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser().absolute() if root is not None else default_cache_dir()
        with os_errors(f"creating the cache directory {self.root} (pass another with --cache)"):
            for sub in ("blobs", "snapshots", "locks", "tmp"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)

    def path(self, blob: str) -> Path:
        check_id(blob)
        return self.root / "blobs" / blob

    def has(self, blob: str) -> bool:
        return self.path(blob).is_file()

    def add_file(self, blob: str, src: str | os.PathLike[str], *, move: bool = False) -> Path:
        """Put the file at ``src`` into the cache as ``blob`` after checking that it hashes to it. With ``move``,
        ``src`` is renamed into place (when it is on the cache's filesystem) instead of copied."""
        dst = self.path(blob)
        src = Path(src)
        with os_errors(f"adding {src} to the cache {self.root}"):
            actual = file_blob_id(src)
            if actual != blob:
                raise CorruptBlob(f"{src} hashes to {actual}, not {blob}; it cannot enter the cache under that name")
            if move:
                try:
                    with open(src, "rb") as f:
                        os.fsync(f.fileno())
                    os.replace(src, dst)
                    fsync_dir(dst.parent)
                    return dst
                except OSError:
                    pass  # another filesystem: copy instead
            write_atomic(dst, lambda f: copy_into(f, src))
        return dst

    def add_manifest(self, snapshot_id: str, data: bytes) -> None:
        check_id(snapshot_id, "snapshot")
        if blob_id(data) != snapshot_id:
            raise CorruptBlob(f"manifest bytes hash to {blob_id(data)}, not snapshot {snapshot_id}")
        with os_errors(f"writing a manifest into the cache {self.root}"):
            write_atomic(self._manifest_path(snapshot_id), lambda f: write_all(f, data))

    def get_manifest(self, snapshot_id: str) -> bytes | None:
        """The cached manifest of the snapshot, or None when it is not cached (or damaged)."""
        check_id(snapshot_id, "snapshot")
        try:
            data = self._manifest_path(snapshot_id).read_bytes()
        except FileNotFoundError:
            return None
        return data if blob_id(data) == snapshot_id else None

    def has_manifest(self, snapshot_id: str) -> bool:
        return self.get_manifest(snapshot_id) is not None

    def blob_lock(self, blob: str) -> BlobLock:
        check_id(blob)
        return BlobLock(self.root / "locks" / blob)

    def temp_path(self, blob: str) -> Path:
        """Where a download of ``blob`` is written; only the holder of its lock touches it."""
        check_id(blob)
        return self.root / "tmp" / blob

    def _manifest_path(self, snapshot_id: str) -> Path:
        return self.root / "snapshots" / f"{snapshot_id}.msgpack"


class BlobLock:
    """An exclusive flock on a per-blob file, between processes and between threads alike.

    The holder deletes the file before unlocking, so locks leave nothing behind. A waiter that wakes up on
    a deleted file holds a lock that guards nothing; it notices (the path no longer names its file) and
    tries again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def acquire(self, blocking: bool = True) -> bool:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                ours = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                ours = False
            if ours:
                self._fd = fd
                return True
            os.close(fd)

    def release(self) -> None:
        if self._fd < 0:
            return
        with suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)  # closing drops the flock
        self._fd = -1


# Progress ------------------------------------------------------------------------------------------------


class Progress:
    """Bytes and blobs moved, with rates, on stderr when it is a terminal; silent otherwise or when quiet.
    Thread-safe: parts and uploads report from worker threads."""

    def __init__(self, desc: str, *, quiet: bool = False, file: Any = None) -> None:
        self.desc = desc
        self.file = file or sys.stderr
        self.enabled = not quiet and bool(getattr(self.file, "isatty", lambda: False)())
        self._bar: Any = None
        self._lock = threading.Lock()
        self._blobs_total = 0
        self._blobs_done = 0
        self._started = 0.0

    def start(self, total_bytes: int, total_blobs: int) -> None:
        self._blobs_total = total_blobs
        self._started = time.monotonic()
        if self.enabled and total_blobs:
            from tqdm import tqdm  # type: ignore[import-untyped]

            self._bar = tqdm(total=total_bytes, desc=self.desc, unit="B", unit_scale=True,
                             file=self.file, dynamic_ncols=True)
            self._bar.set_postfix_str(self._blobs_text(), refresh=False)

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(nbytes)

    def blob_done(self) -> None:
        with self._lock:
            self._blobs_done += 1
            if self._bar is not None:
                self._bar.set_postfix_str(self._blobs_text())

    def forget(self, nbytes: int) -> None:
        """A blob that another process brought in: no longer ours to count."""
        with self._lock:
            self._blobs_total -= 1
            if self._bar is not None:
                self._bar.total -= nbytes
                self._bar.set_postfix_str(self._blobs_text())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _blobs_text(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return f"{self._blobs_done}/{self._blobs_total} blobs, {self._blobs_done / elapsed:.1f} blobs/s"


def _progress(progress: bool | Progress | None, desc: str) -> Progress:
    if isinstance(progress, Progress):
        return progress
    return Progress(desc, quiet=not progress)


# Pull ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PullStats:
    blobs_total: int
    blobs_downloaded: int
    bytes_downloaded: int
    seconds: float


class _Download:
    """One blob being written into its temporary file by several parts at once.

    The hash is computed in order while parts complete: whenever the next unhashed part is done, the thread
    that finished it reads it back (from the page cache, where it was just written) and feeds the hasher.
    Measured against hashing the whole file after its last part (300 MB in 4 blobs, medians of 5-9 runs):
    equal within noise, 0.144 s vs 0.146 s from a local store and 0.755 s vs 0.745 s from moto on loopback;
    xxh3 runs at about 20 GB/s and releases the GIL. We hash as parts complete because it verifies while the
    blob streams, adds no pass after the last part, and never rereads pages that may have been evicted.
    """

    def __init__(self, cache: BlobCache, blob: str, size: int, lock: BlobLock) -> None:
        self.blob, self.size, self.lock = blob, size, lock
        self.cache = cache
        self.tmp = cache.temp_path(blob)
        self._fd = -1
        self._mutex = threading.Lock()
        self._hasher = xxhash.xxh3_128()
        self._hashed = 0
        self._done: dict[int, int] = {}  # start -> end of finished parts not yet hashed
        self.finished = False

    def open(self) -> None:
        with os_errors(f"writing blob {self.blob} into the cache {self.cache.root}"):
            self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            if self.size:
                try:
                    os.posix_fallocate(self._fd, 0, self.size)  # a full disk fails here, before any download
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate
                        raise
                    os.ftruncate(self._fd, self.size)

    def write(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        with os_errors(f"writing blob {self.blob} into the cache {self.cache.root}"):
            while view:
                written = os.pwrite(self._fd, view, offset)
                view, offset = view[written:], offset + written

    def part_done(self, start: int, end: int) -> bool:
        """Record a finished part; returns True when the whole blob is written and hashed."""
        with self._mutex:
            self._done[start] = end
            while self._hashed in self._done:
                stop = self._done.pop(self._hashed)
                for pos in range(self._hashed, stop, CHUNK):
                    self._hasher.update(os.pread(self._fd, min(CHUNK, stop - pos), pos))
                self._hashed = stop
            return self._hashed == self.size

    def finish(self, store: Store, snapshot: str | None) -> None:
        """Verify, make durable, rename into the cache, unlock."""
        digest = self._hasher.hexdigest()
        if digest != self.blob:
            of = f" of snapshot {snapshot}" if snapshot else ""
            raise CorruptBlob(f"blob {self.blob}{of} in {store.uri} does not match its name (its bytes hash to "
                              f"{digest}); the store's copy is corrupt: push the snapshot again")
        with os_errors(f"writing blob {self.blob} into the cache {self.cache.root}"):
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self.tmp, self.cache.path(self.blob))
        self.finished = True
        self.lock.release()

    def abandon(self) -> None:
        """Leave nothing behind: close, delete the temporary file, unlock."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not self.finished:
            with suppress(FileNotFoundError):
                os.unlink(self.tmp)
        self.lock.release()


class _Puller:
    def __init__(self, store: Store, cache: BlobCache, concurrency: int, part_size: int, progress: Progress,
                 snapshot: str | None) -> None:
        self.store, self.cache, self.progress, self.snapshot = store, cache, progress, snapshot
        self.concurrency, self.part_size = concurrency, part_size
        self.cancelled = threading.Event()
        self.blobs = 0
        self.bytes = 0
        self._count = threading.Lock()

    def run(self, sizes: dict[str, int]) -> None:
        """Download every blob of ``sizes`` that no other process is downloading, then wait for the others
        and download any that their process failed to bring in."""
        mine, theirs = [], []
        for blob, size in sizes.items():
            lock = self.cache.blob_lock(blob)
            if not lock.acquire(blocking=False):
                theirs.append(blob)
            elif self.cache.has(blob):  # finished by another process since we looked
                lock.release()
                self.progress.forget(size)
            else:
                mine.append(_Download(self.cache, blob, size, lock))
        self._download(mine)
        # One lock at a time, taken in id order and held only while downloading: no process waits on a lock
        # while holding another, so processes cannot deadlock.
        for blob in sorted(theirs):
            lock = self.cache.blob_lock(blob)
            lock.acquire(blocking=True)
            if self.cache.has(blob):
                lock.release()
                self.progress.forget(sizes[blob])
            else:
                self._download([_Download(self.cache, blob, sizes[blob], lock)])

    def _download(self, downloads: list[_Download]) -> None:
        try:
            for d in downloads:
                d.open()
            parts = [(d, start, min(start + self.part_size, d.size))
                     for d in downloads for start in range(0, d.size, self.part_size)]
            for d in downloads:
                if d.size == 0 and d.part_done(0, 0):
                    self._finish(d)
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="pull") as pool:
                futures: list[Future[None]] = [pool.submit(self._part, d, s, e) for d, s, e in parts]
                try:
                    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                    for f in done:
                        f.result()  # raises the first failure
                except BaseException:
                    self.cancelled.set()  # parts in flight stop at their next piece
                    for f in futures:
                        f.cancel()
                    raise
        finally:
            for d in downloads:
                if not d.finished:
                    d.abandon()

    def _part(self, d: _Download, start: int, end: int) -> None:
        pos, attempt = start, 0
        while pos < end:
            if self.cancelled.is_set():
                return
            try:
                for chunk in self.store.stream_range(d.blob, pos, end):
                    if len(chunk) > end - pos:
                        raise StoreError(f"{self.store.uri} sent more bytes of blob {d.blob} than asked for; "
                                         "the store does not serve byte ranges correctly")
                    d.write(pos, chunk)
                    pos += len(chunk)
                    self.progress.advance(len(chunk))
                    if self.cancelled.is_set():
                        return
            except TransferInterrupted as e:  # botocore retried the request itself; the body is ours to resume
                attempt += 1
                if attempt > RETRIES:
                    raise
                log.debug("blob %s: retrying from byte %d (attempt %d): %s", d.blob, pos, attempt + 1, e)
                time.sleep(BACKOFF_SECONDS * 2 ** (attempt - 1) * (0.5 + random.random()))
                continue  # resume from what arrived
            if pos < end:
                of = f" of snapshot {self.snapshot}" if self.snapshot else ""
                raise CorruptBlob(f"blob {d.blob}{of} in {self.store.uri} is truncated: it ends at byte {pos}, "
                                  f"the manifest says {d.size}; push the snapshot again")
        if d.part_done(start, end):
            self._finish(d)

    def _finish(self, d: _Download) -> None:
        d.finish(self.store, self.snapshot)
        with self._count:
            self.blobs += 1
            self.bytes += d.size
        self.progress.blob_done()


def pull_blobs(store: Store, cache: BlobCache, sizes: dict[str, int], *, concurrency: int = DEFAULT_CONCURRENCY,
               part_size: int = DEFAULT_PART_SIZE, progress: bool | Progress | None = None,
               snapshot: str | None = None) -> PullStats:
    """Bring the blobs of ``sizes`` ({id: size}) into the cache with parallel ranged GETs over parts of all
    blobs at once, each verified against its id before it is renamed into place. Safe when several processes
    pull at once: a per-blob lock makes each blob download once; the others wait for it. ``snapshot`` only
    names the snapshot in errors."""
    if concurrency < 1 or part_size < 1:
        raise ValueError("concurrency and part_size must be positive")
    of = f"snapshot {snapshot}" if snapshot else "the blob list"
    for blob, size in sizes.items():
        if not isinstance(blob, str) or not is_id(blob) or not isinstance(size, int) or size < 0:
            raise StoreError(f"{of} lists an invalid blob ({str(blob)[:80]!r}: {str(size)[:20]}); rebuild it")
    started = time.monotonic()
    missing = {blob: size for blob, size in sorted(sizes.items()) if not cache.has(blob)}
    reporter = _progress(progress, "pull")
    reporter.start(sum(missing.values()), len(missing))
    puller = _Puller(store, cache, concurrency, part_size, reporter, snapshot)
    try:
        puller.run(missing)
    finally:
        reporter.close()
    with suppress(OSError):
        fsync_dir(cache.root / "blobs")
    return PullStats(len(sizes), puller.blobs, puller.bytes, time.monotonic() - started)


def pull_snapshot(store: Store, cache: BlobCache, snapshot_id: str, *, concurrency: int = DEFAULT_CONCURRENCY,
                  part_size: int = DEFAULT_PART_SIZE,
                  progress: bool | Progress | None = None) -> tuple[bytes, PullStats]:
    """Fetch the snapshot's manifest and every blob it lists into the cache; returns the manifest bytes.
    The manifest is cached last, so a cached manifest means its blobs are all in the cache."""
    raw = cache.get_manifest(snapshot_id) or store.get_manifest(snapshot_id)
    manifest = Manifest.decode(raw, where=f"snapshot {snapshot_id} in {store.uri}")
    try:
        sizes = manifest.blob_sizes()
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"snapshot {snapshot_id} in {store.uri} has no valid blob list; rebuild it") from None
    stats = pull_blobs(store, cache, sizes, concurrency=concurrency, part_size=part_size, progress=progress,
                       snapshot=snapshot_id)
    cache.add_manifest(snapshot_id, raw)
    return raw, stats


# Push ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PushStats:
    blobs_total: int
    blobs_uploaded: int
    bytes_uploaded: int


def push_blobs(store: Store, paths: dict[str, Path], *, concurrency: int = PUSH_CONCURRENCY,
               progress: bool | Progress | None = None) -> PushStats:
    """Upload the blobs ({id: file}) that the store lacks; each file is checked against its id first."""
    if concurrency < 1:
        raise ValueError("concurrency must be positive")
    for blob, path in paths.items():
        check_id(blob)
        if not Path(path).is_file():
            raise StoreError(f"blob file {path} is missing; rebuild the snapshot")
    with ThreadPoolExecutor(concurrency, thread_name_prefix="push") as pool:
        present = dict(zip(paths, pool.map(store.has_blob, paths), strict=True))
        missing = {blob: Path(path) for blob, path in sorted(paths.items()) if not present[blob]}
        sizes = {blob: path.stat().st_size for blob, path in missing.items()}
        reporter = _progress(progress, "push")
        reporter.start(sum(sizes.values()), len(missing))

        def upload(blob: str) -> None:
            store.put_blob(blob, missing[blob], on_bytes=reporter.advance)
            reporter.blob_done()

        try:
            futures = [pool.submit(upload, blob) for blob in missing]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                f.cancel()
            for f in done:
                f.result()
        finally:
            reporter.close()
    return PushStats(len(paths), len(missing), sum(sizes.values()))


def push_snapshot(store: Store, manifest_bytes: bytes, snapshot_id: str, paths: dict[str, Path], *,
                  concurrency: int = PUSH_CONCURRENCY, progress: bool | Progress | None = None) -> PushStats:
    """Upload the snapshot's missing blobs, then its manifest. The manifest goes last, so a reader never sees
    a snapshot with missing blobs; a push that dies midway leaves only unreferenced blobs, which gc removes."""
    check_id(snapshot_id, "snapshot")
    if blob_id(manifest_bytes) != snapshot_id:
        raise CorruptBlob(f"the manifest given does not hash to snapshot {snapshot_id}; push the one the build wrote")
    needed = Manifest.decode(manifest_bytes, where=f"snapshot {snapshot_id}").blob_ids()
    absent = sorted(needed - set(paths))
    if absent:
        raise StoreError(f"snapshot {snapshot_id} needs {len(absent)} blob(s) that were not given, such as "
                         f"{absent[0]}; rebuild the snapshot")
    stats = push_blobs(store, {blob: paths[blob] for blob in needed}, concurrency=concurrency, progress=progress)
    store.put_manifest(snapshot_id, manifest_bytes)
    return stats


# Refs and gc ---------------------------------------------------------------------------------------------


def resolve_ref(store: Store, ref: str) -> str:
    """The snapshot id that ``ref`` names: a full id, a ref name, or a unique id prefix of at least 4 digits
    (looked up in that order, so a ref named like a prefix wins)."""
    ref = ref.strip()
    if not ref:
        raise StoreError("no snapshot given; pass an id, an id prefix or a ref name")
    if is_id(ref):
        if store.has_manifest(ref):
            return ref
        raise NotFound(f"snapshot {ref} not found in {store.uri} (try 'warmstart ls --store {store.uri}')")
    if is_ref_name(ref):
        try:
            return store.get_ref(ref)
        except NoSuchBucket:
            raise
        except NotFound:
            pass
    snapshots = store.list_snapshots()
    hexdigits = all(c in "0123456789abcdef" for c in ref)
    if hexdigits and len(ref) >= MIN_PREFIX:
        candidates = [s for s in snapshots if s.startswith(ref)]
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise StoreError(f"id prefix {ref!r} is ambiguous in {store.uri}: it matches "
                             f"{', '.join(candidates[:10])}{' ...' if len(candidates) > 10 else ''}; give more digits")
    refs = store.list_refs()
    short = hint = ""
    if hexdigits and len(ref) < MIN_PREFIX:
        short = f" (an id prefix needs at least {MIN_PREFIX} digits)"
    if refs:
        hint += f"refs: {', '.join(sorted(refs)[:10])}{' ...' if len(refs) > 10 else ''}; "
    if snapshots:
        hint += f"snapshots: {', '.join(s[:12] for s in snapshots[:10])}{' ...' if len(snapshots) > 10 else ''}"
    else:
        hint += "no snapshots"
    raise NotFound(f"no snapshot or ref {ref!r} in {store.uri}{short}; {hint.rstrip('; ')}")


@dataclass(frozen=True)
class GcReport:
    blobs_deleted: int  # or that would be deleted, in a dry run
    bytes_freed: int
    kept: int  # blobs left: referenced, or unreferenced but younger than the grace period
    kept_in_grace: int  # the unreferenced ones among them


def gc(store: Store, *, dry_run: bool = False, grace_seconds: float = 3600) -> GcReport:
    """Delete the store's blobs that no manifest references.

    A push uploads its blobs before its manifest, so while a push is in flight its new blobs are referenced
    by nothing yet: blobs younger than ``grace_seconds`` are kept for that reason. A push that reuses an old
    unreferenced blob (left by a crashed push) can still lose it to a gc running at the same moment; do not
    gc while pushing with a grace period shorter than pushes take.
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
    now = time.time()
    deleted = freed = in_grace = 0
    for blob, size, modified in blobs:
        if blob in referenced:
            continue
        if now - modified < grace_seconds:
            in_grace += 1
            continue
        if not dry_run:
            store.delete_blob(blob)
        deleted += 1
        freed += size
    return GcReport(deleted, freed, len(blobs) - deleted, in_grace)


__all__ = ["BlobCache", "BlobLock", "CorruptBlob", "GcReport", "Progress", "PullStats", "PushStats",
           "default_cache_dir", "gc", "pull_blobs", "pull_snapshot", "push_blobs", "push_snapshot", "resolve_ref"]
