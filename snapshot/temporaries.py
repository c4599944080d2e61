"""What killed writers leave behind in a local store and in the cache, and removing it once it is stale.

A process killed mid-write (kill -9, the OOM killer, a node going away) leaves its temporary files:

    .<name>.<12 hex>.tmp    beside the file it was writing (snapshot.files.write_atomic), in a local store's
                            blobs/, snapshots/ and refs/, and in the cache's blobs/ and snapshots/
    tmp/<blob id>           a download in flight, in the cache (its writer holds locks/<blob id>)
    locks/<blob id>         a download's lock file, in the cache (its holder deletes it; a killed one cannot)
    tmpXXXXXXXX/            a build's staging directory, in the cache root (tempfile.TemporaryDirectory)

One is stale when nothing has written to it for the grace period, so a live writer's file is never touched.
A download's file and a lock file are also removed only while their lock is free, so a download in flight
is never touched, however slow. A dry run counts by age alone and touches nothing.

An S3 store writes no temporary objects; a multipart upload cut off by a kill stays until it is aborted,
which a bucket lifecycle rule (AbortIncompleteMultipartUpload) does.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from warmstart.snapshot.cache import BlobLock
from warmstart.snapshot.files import os_errors
from warmstart.snapshot.format import is_id
from warmstart.snapshot.store import LocalStore, Store

ATOMIC_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")  # write_atomic's names
STAGING_DIRECTORY = re.compile(r"^tmp[a-z0-9_]{8}$")  # tempfile's names


@dataclass
class Removed:
    count: int = 0
    bytes: int = 0

    def add(self, size: int) -> None:
        self.count += 1
        self.bytes += size


def remove_store_temporaries(store: Store, cutoff: float, *, dry_run: bool = False) -> Removed:
    """Remove the store's temporary files last written before ``cutoff`` (epoch seconds)."""
    removed = Removed()
    if isinstance(store, LocalStore):
        with os_errors(f"removing stale temporary files from the store {store.uri}"):
            for folder in ("blobs", "snapshots", "refs", "loras"):
                _remove_atomic_temporaries(store.root / folder, cutoff, dry_run, removed)
    return removed


def remove_cache_temporaries(root: Path, cutoff: float, *, dry_run: bool = False) -> Removed:
    """Remove the temporary files and directories in the cache at ``root`` last written before ``cutoff``."""
    removed = Removed()
    with os_errors(f"removing stale temporary files from the cache {root}"):
        for folder in ("blobs", "snapshots"):
            _remove_atomic_temporaries(root / folder, cutoff, dry_run, removed)
        _remove_downloads(root, cutoff, dry_run, removed)
        _remove_lock_files(root / "locks", cutoff, dry_run, removed)
        _remove_staging_directories(root, cutoff, dry_run, removed)
    return removed


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _stale_file_size(path: Path, cutoff: float) -> int | None:
    """The file's size when it is a plain file last written before ``cutoff``; None otherwise (or gone)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff else None


def _remove_atomic_temporaries(folder: Path, cutoff: float, dry_run: bool, removed: Removed) -> None:
    for entry in _entries(folder):
        if ATOMIC_TEMPORARY.match(entry.name) and (size := _stale_file_size(Path(entry.path), cutoff)) is not None:
            if not dry_run:
                Path(entry.path).unlink(missing_ok=True)
            removed.add(size)


def _remove_downloads(root: Path, cutoff: float, dry_run: bool, removed: Removed) -> None:
    for entry in _entries(root / "tmp"):
        path = Path(entry.path)
        if not is_id(entry.name) or _stale_file_size(path, cutoff) is None:
            continue
        if dry_run:
            removed.add(path.stat().st_size)
            continue
        lock = BlobLock(root / "locks" / entry.name)
        if not lock.acquire(blocking=False):
            continue  # a download in flight
        try:
            if (size := _stale_file_size(path, cutoff)) is not None:  # as seen under the lock
                path.unlink()
                removed.add(size)
        finally:
            lock.release()


def _remove_lock_files(folder: Path, cutoff: float, dry_run: bool, removed: Removed) -> None:
    for entry in _entries(folder):
        path = Path(entry.path)
        if not is_id(entry.name) or _stale_file_size(path, cutoff) is None:
            continue
        if dry_run:
            removed.add(0)
            continue
        lock = BlobLock(path)
        if lock.acquire(blocking=False):  # held: a download in flight
            lock.release()  # which deletes the file, as a holder does
            removed.add(0)


def _remove_staging_directories(root: Path, cutoff: float, dry_run: bool, removed: Removed) -> None:
    for entry in _entries(root):
        if not STAGING_DIRECTORY.match(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        newest, size = _newest_write_and_size(Path(entry.path))
        if newest < cutoff:
            if not dry_run:
                shutil.rmtree(entry.path, ignore_errors=True)
            removed.add(size)


def _newest_write_and_size(directory: Path) -> tuple[float, int]:
    """The latest modification time of the directory and everything in it, and the bytes of its files."""
    newest, size = directory.lstat().st_mtime, 0
    for folder, _, files in os.walk(directory):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            newest, size = max(newest, st.st_mtime), size + st.st_size
    return newest, size
