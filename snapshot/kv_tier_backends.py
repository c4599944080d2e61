"""Where the KV tier's segments live (runtime/engine/kv_tier.py): a bounded local directory that survives a
process restart on the same host, or the object store snapshots live in (same store code and credentials).

The tier holds users' conversations: the object store backend is opt-in (`--kv-tier s3`), every segment is
named under its tenant namespace and the snapshot's id, and the disk backend keeps its files readable by the
serving user only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
import time
from pathlib import Path

from warmstart.snapshot.errors import StoreError
from warmstart.snapshot.files import os_errors, write_all, write_atomic
from warmstart.snapshot.store import Store

SEGMENT_SUFFIX = ".kv"
KEY_FILE, KEY_BYTES = ".key", 32
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600


def _is_segment(path: Path) -> bool:
    # a write cut short leaves a hidden temporary, never counted
    return path.name.endswith(SEGMENT_SUFFIX) and not path.name.startswith(".")


class DiskBackend:
    """Segments as files under ``root``, at most ``max_bytes`` of them: the least recently used go first.

    Recency is the file's modification time (a read touches it), so a restarted process keeps the order; the
    index is rebuilt by one scan at start, and again before a write at most every ``rescan_seconds``, so that the
    budget holds for the directory, whichever instances share it (between scans it may be passed by what the
    others wrote since). Folders are 0700 and segments 0600; a directory that exists with wider permissions is
    tightened at start (folders and segments under it too), or refused where it is not ours."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, rescan_seconds: float = 5.0) -> None:
        if max_bytes < 1:
            raise ValueError(f"the KV tier's disk budget must be positive, not {max_bytes}")
        self.root, self.max_bytes = Path(root).expanduser().absolute(), max_bytes
        self.rescan_seconds = rescan_seconds
        self._lock = threading.Lock()
        self._sizes: dict[Path, int] = {}
        self._used: dict[Path, float] = {}
        with os_errors(f"preparing the KV tier directory {self.root}"):
            self.root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
            self._make_private(self.root, PRIVATE_DIR)
            entries = list(self.root.rglob("*"))  # one walk for the permissions and the index
            for folder in (p for p in entries if p.is_dir() and not p.is_symlink()):
                self._make_private(folder, PRIVATE_DIR)
            segments = [p for p in entries if _is_segment(p)]
            for path in segments:
                self._make_private(path, PRIVATE_FILE)
            self._scan(segments)
        self._evict_over(self.max_bytes)

    def _scan(self, segments: list[Path] | None = None) -> None:
        """The index from what the directory holds now (other instances' segments included); ``segments``: a walk
        of it just made."""
        sizes, used = {}, {}
        walked = segments if segments is not None else [p for p in self.root.rglob(f"*{SEGMENT_SUFFIX}")
                                                        if _is_segment(p)]  # fmt: skip
        for path in walked:
            with contextlib.suppress(FileNotFoundError):  # evicted by another instance meanwhile
                st = path.stat()
                sizes[path], used[path] = st.st_size, st.st_mtime
        with self._lock:
            self._sizes, self._used = sizes, used
            self._scanned = time.monotonic()

    def shared_key(self) -> bytes:
        """The key that signs this directory's segments when none is given: 32 random bytes in ``.key`` (0600),
        made by the first instance to use the directory and read by the others, so that only the serving user (who
        alone can read the directory) can sign a segment."""
        path = self.root / KEY_FILE
        with os_errors(f"reading the KV tier's key {path}"):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
            except FileExistsError:
                key = path.read_bytes()
                if len(key) != KEY_BYTES:
                    raise StoreError(f"the KV tier's key {path} is {len(key)} bytes, not {KEY_BYTES}; delete it (the "
                                     "segments signed with it are then refused) and start again") from None
                return key
            key = secrets.token_bytes(KEY_BYTES)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
                f.flush()
                os.fsync(f.fileno())
            return key

    def _make_private(self, path: Path, mode: int) -> None:
        """``path`` readable by the serving user only: tightened if it is wider, refused if it is not ours."""
        st = path.lstat()
        if stat.S_IMODE(st.st_mode) & 0o077 == 0:
            return
        if st.st_uid != os.geteuid():
            raise StoreError(f"the KV tier directory {self.root} holds {path}, which others can read (mode "
                             f"{stat.S_IMODE(st.st_mode):o}) and which belongs to another user, so it cannot be "
                             "tightened: the tier holds users' conversations; give --kv-tier-dir a directory of the "
                             "serving user's own")
        os.chmod(path, mode)

    def _make_dirs(self, folder: Path) -> None:
        """``folder`` and the folders between it and the root, each created 0700 (mkdir's mode beats the umask
        only for the last folder of parents=True)."""
        missing = []
        while folder != self.root and not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for path in reversed(missing):
            with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
                path.mkdir(mode=PRIVATE_DIR)

    @property
    def bytes_stored(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def _path(self, key: str) -> Path:
        path = (self.root / f"{key}{SEGMENT_SUFFIX}").absolute()
        if self.root not in path.parents or ".." in key.split("/"):
            raise ValueError(f"not a KV segment name: {key[:200]!r}")
        return path

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        with self._lock:
            if path in self._sizes:
                self._used[path] = time.time()
        # Evicted meanwhile is fine: what was read is whole (files are replaced, never rewritten in place).
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return  # larger than the whole budget: not worth evicting everything for
        if time.monotonic() - self._scanned >= self.rescan_seconds:
            with os_errors(f"scanning the KV tier directory {self.root}"):
                self._scan()
        self._evict_over(self.max_bytes - len(data))
        path = self._path(key)
        with os_errors(f"writing a KV segment into {self.root}"):
            self._make_dirs(path.parent)
            write_atomic(path, lambda f: write_all(f, data), mode=PRIVATE_FILE)
        with self._lock:
            self._sizes[path], self._used[path] = len(data), time.time()

    def _evict_over(self, budget: int) -> None:
        """Delete least recently used segments until at most ``budget`` bytes remain."""
        with self._lock:
            total = sum(self._sizes.values())
            for path in sorted(self._used, key=self._used.__getitem__):
                if total <= budget:
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                total -= self._sizes.pop(path)
                del self._used[path]


class StoreBackend:
    """Segments in a snapshot store (a local directory or s3://), under its kv/ prefix. Age limits on the bucket
    are the bucket's lifecycle rule's job (document it to the user); the tier refuses segments past its TTL."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def get(self, key: str) -> bytes | None:
        return self.store.get_kv_segment(key)

    def put(self, key: str, data: bytes) -> None:
        self.store.put_kv_segment(key, data)
