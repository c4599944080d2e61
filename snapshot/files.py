"""Local files for the local store and the cache: atomic writes, durable renames, chunked copies, the user's
cache directory, and OSErrors turned into StoreErrors that say what to do."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from warmstart.snapshot.errors import AccessDenied, StoreError

CHUNK = 8 << 20  # copy and stream in pieces this large

OnBytes = Callable[[int], None]


def user_cache_dir() -> Path:
    """warmstart's directory under the user's cache ($XDG_CACHE_HOME or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "warmstart"


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, fill: Callable[[BinaryIO], None], mode: int = 0o644) -> None:
    """Write ``path`` through a temporary file in the same directory (fsync, then rename), so that readers see
    the old content or the new one, never a part. ``mode``: the file's permissions (before the umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"  # names starting with '.' are never listed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_all(f: BinaryIO, data: bytes) -> None:
    f.write(data)


def copy_into(dst: BinaryIO, src_path: Path, on_bytes: OnBytes | None = None) -> None:
    with open(src_path, "rb") as src:
        while chunk := src.read(CHUNK):
            dst.write(chunk)
            if on_bytes:
                on_bytes(len(chunk))


@contextmanager
def os_errors(doing: str) -> Iterator[None]:
    """Turn an OSError into a StoreError that says what we were doing and what to do about it."""
    try:
        yield
    except StoreError:
        raise
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        if e.errno == errno.ENOSPC:
            raise StoreError(f"the disk is full while {doing}{where}; free some space or use another directory") \
                from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise AccessDenied(f"permission denied while {doing}{where}; check the directory's owner and mode, "
                               "or use another directory") from None
        raise StoreError(f"{e.strerror or e} while {doing}{where}") from None
