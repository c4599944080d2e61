"""The local blob cache: verified blobs and manifests on disk, and the per-blob locks of downloads.

Cache layout (under $WARMSTART_CACHE or ~/.cache/warmstart/cache):

    blobs/<id>                  verified blobs, ready to map
    snapshots/<id>.msgpack      manifests of snapshots whose blobs are all here
    locks/<id>                  one lock file per blob while some process is downloading it
    tmp/                        blobs being downloaded (one file per blob, named by its id)

A blob enters ``blobs/`` only by a rename after its bytes were verified against its name, so whatever is
there is whole and correct, whichever process put it there.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import suppress
from pathlib import Path

from snapshot.errors import CorruptBlob
from snapshot.files import copy_into, fsync_dir, os_errors, user_cache_dir, write_all, write_atomic
from snapshot.format import blob_id, file_blob_id
from snapshot.store import check_id


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
