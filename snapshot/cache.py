"""The local blob cache: verified blobs and manifests on disk, and the per-blob locks of downloads.

Cache layout (under $WARMSTART_CACHE or ~/.cache/warmstart/cache):

    blobs/<id>                  verified blobs, ready to map
    snapshots/<id>.msgpack      manifests of snapshots whose blobs are all here
    locks/<id>                  one lock file per blob while some process is downloading it
    tmp/                        blobs being downloaded (one file per blob, named by its id)
    kernels/<key>/              Triton's compiled kernels, per GPU architecture and versions (written by Triton
                                when serving on a GPU, see snapshot.loader and runtime.kernels.carried_cache_dir)

A blob enters ``blobs/`` only by a rename after its bytes were verified against its name. What is there can
still be damaged later (a disk filling up, a tool writing into the file), so loads check every blob's size
against the manifest (a stat), and `pull` and `warmstart verify` check hashes; a bad blob is removed under
its lock and fetched again.
"""

from __future__ import annotations

import fcntl
import os
import stat
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import xxhash

from warmstart.snapshot.errors import CorruptBlob
from warmstart.snapshot.files import copy_into, fsync_dir, os_errors, user_cache_dir, write_all, write_atomic
from warmstart.snapshot.format import blob_id, file_blob_id, is_id
from warmstart.snapshot.store import check_id

HASH_CHUNK = 1 << 20  # read and hash in pieces this large: measured faster than 8 MiB (they stay in cache)


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

    def has(self, blob: str, size: int | None = None) -> bool:
        """Whether the blob is in the cache and, given ``size``, has that many bytes (a stat; nothing is read)."""
        try:
            st = self.path(blob).stat()
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)

    def find_bad(self, blob: str, size: int | None = None, *, verify_hash: bool = True) -> BadBlob | None:
        """The cached blob if it is damaged: not ``size`` bytes (when given) or, with ``verify_hash``, not hashing
        to its name. None when it is whole, and when it is not in the cache at all."""
        path = self.path(blob)
        with os_errors(f"checking blob {blob} in the cache {self.root}"):
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if size is not None and st.st_size != size:
                        return BadBlob(blob, f"it is {st.st_size:,} bytes, the manifest says {size:,}", _identity(st))
                    actual = _hash_open_file(f) if verify_hash else blob
            except FileNotFoundError:
                return None
        if actual != blob:
            return BadBlob(blob, f"its bytes hash to {actual}", _identity(st))
        return None

    def discard(self, bad: BadBlob) -> bool:
        """Remove a blob found bad, unless it was replaced since (a rename by a pull is atomic, so a changed file is
        a verified one). Taken under the blob's lock, so a download in flight finishes first."""
        lock = self.blob_lock(bad.blob)
        lock.acquire()
        try:
            path = self.path(bad.blob)
            with os_errors(f"removing damaged blob {bad.blob} from the cache {self.root}"):
                try:
                    if _identity(path.stat()) != bad.identity:
                        return False
                    path.unlink()
                except FileNotFoundError:
                    return False
                fsync_dir(path.parent)
            return True
        finally:
            lock.release()

    def blob_ids(self) -> list[str]:
        """Every blob in the cache."""
        with os_errors(f"listing the cache {self.root}"):
            return sorted(e.name for e in os.scandir(self.root / "blobs") if is_id(e.name) and e.is_file())

    def snapshot_ids(self) -> list[str]:
        """Every snapshot whose manifest is cached (damaged ones included; get_manifest tells them apart)."""
        with os_errors(f"listing the cache {self.root}"):
            names = (e.name.removesuffix(".msgpack") for e in os.scandir(self.root / "snapshots")
                     if e.name.endswith(".msgpack"))
            return sorted(n for n in names if is_id(n))

    def remove_manifest(self, snapshot_id: str) -> None:
        check_id(snapshot_id, "snapshot")
        with os_errors(f"removing a manifest from the cache {self.root}"):
            self._manifest_path(snapshot_id).unlink(missing_ok=True)

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


@dataclass(frozen=True)
class BadBlob:
    """A cached blob that is not what its name says."""

    blob: str
    problem: str  # what is wrong, in words ("it is 10 bytes, the manifest says 20")
    identity: tuple[int, int, int, int]  # (device, inode, size, mtime_ns) of the file found bad


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _hash_open_file(f: BinaryIO) -> str:
    h = xxhash.xxh3_128()
    while chunk := f.read(HASH_CHUNK):
        h.update(chunk)
    return h.hexdigest()


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
