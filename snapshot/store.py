"""Stores hold snapshots: blobs named by their content hash, manifests named by the snapshot id, and refs.

The layout is the same in every kind of store, relative to its root:

    blobs/<id>                  immutable bytes; id = xxh3-128 of the content
    snapshots/<id>.msgpack      a manifest; id = xxh3-128 of these bytes (the snapshot id)
    refs/<name>                 text: a snapshot id (refs are the only thing ever overwritten)
    loras/<snapshot id>.<name>  text: the id of the blob holding a LoRA adapter pushed against that snapshot
                                (`warmstart lora push`; overwritten like a ref; see snapshot/lora.py)

Two kinds: a local directory (a plain path or file://PATH; `LocalStore`, here) and S3 or any S3-compatible
endpoint (s3://BUCKET/PREFIX; `S3Store` in snapshot.s3). `Store` holds the layout and the checks; a kind only
moves bytes by key.
Every failure is a StoreError whose message is one sentence saying what was wrong and what to do.
Credentials never appear in a message or a log line.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from warmstart.snapshot import retry
from warmstart.snapshot.errors import CorruptBlob, NoSuchBucket, NotFound, StoreError, TransferInterrupted
from warmstart.snapshot.files import CHUNK, OnBytes, copy_into, os_errors, user_cache_dir, write_all, write_atomic
from warmstart.snapshot.format import blob_id, file_blob_id, is_id

log = logging.getLogger("warmstart.snapshot")

MAX_REF_LENGTH = 128
REF_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
MIN_ID_PREFIX = 4  # the shortest id prefix that names a snapshot
ID_OR_PREFIX = re.compile(rf"^[0-9a-fA-F]{{{MIN_ID_PREFIX},32}}$")
MANIFEST_SUFFIX = ".msgpack"


def default_store_dir() -> Path:
    return Path(os.environ.get("WARMSTART_STORE") or user_cache_dir() / "store").expanduser()


def check_ref_name(name: str) -> None:
    hint = "use letters, digits, '.', '_' and '-'"
    if not name:
        raise StoreError(f"a ref name cannot be empty; {hint}")
    if len(name) > MAX_REF_LENGTH:
        raise StoreError(f"ref name {name[:20]!r}... is {len(name)} characters long; the limit is {MAX_REF_LENGTH}")
    if "/" in name or "\\" in name:
        raise StoreError(f"ref name {name!r} contains a slash; {hint}")
    if ".." in name:
        raise StoreError(f"ref name {name!r} contains '..'; {hint}")
    if not REF_NAME.match(name):
        raise StoreError(f"ref name {name!r} is not allowed; {hint}, starting with a letter, digit or '_'")


def check_new_ref_name(name: str) -> None:
    """check_ref_name, and also refuse names that read as a snapshot id or id prefix: such a ref would hide the
    snapshots whose ids start with it. Only for refs being made, so that older ones stay readable and deletable."""
    check_ref_name(name)
    if ID_OR_PREFIX.match(name):
        raise StoreError(f"ref name {name!r} is only hex digits, so it reads as a snapshot id or id prefix and would "
                         f"hide the snapshots whose id starts with it; use a name with another character, such as "
                         f"'v{name}'")


def check_id(text: str, what: str = "blob") -> None:
    if not isinstance(text, str) or not is_id(text):
        raise StoreError(f"{what} id {str(text)[:80]!r} is not an id (32 lowercase hex digits of an xxh3-128 hash)")


class Store(ABC):
    """Snapshots in one place. Subclasses implement the key-level primitives (the underscored methods)."""

    uri: str

    # Primitives. A key is a '/'-separated path relative to the store's root.
    @abstractmethod
    def _size(self, key: str) -> int | None:
        """The object's size, or None when it does not exist."""

    @abstractmethod
    def _put_file(self, key: str, path: Path, on_bytes: OnBytes | None, checksum: str | None = None) -> None:
        """Store the file; a kind that keeps metadata stores ``checksum`` (a blob's id) beside it."""

    @abstractmethod
    def _put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _get_bytes(self, key: str, what: str) -> bytes:
        """The whole object; raises NotFound naming ``what`` when it does not exist, TransferInterrupted when the
        connection fails while the body streams."""

    @abstractmethod
    def _stream(self, key: str, start: int, end: int, what: str) -> Iterator[bytes]:
        """Bytes [start, end) in pieces. Ends early, without an error, when the object is shorter; raises
        TransferInterrupted when the connection fails midway (the caller may resume from what it received)."""

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(name relative to ``prefix``, size, last-modified epoch seconds) of the objects directly under it."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove the object; absent is fine."""

    @abstractmethod
    def _blob_matches(self, key: str, blob: str, size: int) -> bool | None:
        """Whether the object is ``blob`` whole: None when it does not exist, False when its size or the checksum
        the kind can check (a hash of a local file, the metadata of an S3 object) says it is not."""

    @abstractmethod
    def _touch(self, key: str, blob: str) -> bool:
        """Make the object's last-modified time now (gc judges age by it); False when it does not exist or cannot
        be touched, so that the caller stores it again instead."""

    @abstractmethod
    def _delete_if_older(self, key: str, cutoff: float) -> bool:
        """Delete the object if it was last modified before ``cutoff`` (epoch seconds) as read now, not in an
        earlier listing; returns whether it was deleted. A kind that can makes this atomic with ``_touch``."""

    # Blobs.
    def has_blob(self, blob: str, size: int | None = None) -> bool:
        """Whether the store holds the blob (with that many bytes, given ``size``)."""
        check_id(blob)
        stored = self._size(_blob_key(blob))
        return stored is not None and (size is None or stored == size)

    def blob_matches(self, blob: str, size: int) -> bool | None:
        """Whether the store holds the blob whole (None: not at all; False: damaged, by its size or checksum)."""
        check_id(blob)
        return self._blob_matches(_blob_key(blob), blob, size)

    def refresh_blob(self, blob: str) -> bool:
        """Make the blob young again, so that a gc running meanwhile keeps it through its grace period; False when
        it is gone (or cannot be touched): store it again."""
        check_id(blob)
        return self._touch(_blob_key(blob), blob)

    def delete_blob_if_older(self, blob: str, cutoff: float) -> bool:
        """Delete the blob unless it was modified (or refreshed) at ``cutoff`` or later; returns whether it was."""
        check_id(blob)
        return self._delete_if_older(_blob_key(blob), cutoff)

    def blob_size(self, blob: str) -> int:
        check_id(blob)
        size = self._size(_blob_key(blob))
        if size is None:
            raise NotFound(f"blob {blob} not found in {self.uri}")
        return size

    def put_blob(self, blob: str, path: str | os.PathLike[str], *, on_bytes: OnBytes | None = None) -> None:
        """Store the file at ``path`` as ``blob``, after checking that it hashes to that id."""
        check_id(blob)
        path = Path(path)
        try:
            actual = file_blob_id(path)
        except OSError as e:
            raise StoreError(f"cannot read blob file {path} ({e.strerror}); rebuild the snapshot") from None
        if actual != blob:
            raise CorruptBlob(f"blob file {path} hashes to {actual}, not {blob}; it changed after the build, "
                              "so rebuild the snapshot")
        self._put_file(_blob_key(blob), path, on_bytes, checksum=blob)

    def stream_range(self, blob: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of the blob, in pieces; fewer in total when the stored blob is shorter."""
        check_id(blob)
        if not 0 <= start <= end:
            raise ValueError(f"bad byte range [{start}, {end})")
        return self._stream(_blob_key(blob), start, end, f"blob {blob}")

    def read_range(self, blob: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the blob (end exclusive); raises CorruptBlob when the stored blob is shorter."""
        data = b"".join(self.stream_range(blob, start, end))
        if len(data) != end - start:
            raise CorruptBlob(f"blob {blob} in {self.uri} is truncated: asked for bytes {start}-{end}, "
                              f"got {len(data)}; push the snapshot again")
        return data

    def list_blobs(self) -> Iterator[tuple[str, int, float]]:
        """(id, size, last-modified epoch seconds) of every blob."""
        return ((name, size, mtime) for name, size, mtime in self._list("blobs/") if is_id(name))

    def delete_blob(self, blob: str) -> None:
        check_id(blob)
        self._delete(_blob_key(blob))

    # Manifests.
    def put_manifest(self, snapshot_id: str, data: bytes) -> None:
        check_id(snapshot_id, "snapshot")
        if blob_id(data) != snapshot_id:
            raise CorruptBlob(f"manifest bytes hash to {blob_id(data)}, not snapshot {snapshot_id}; "
                              "push the manifest the build wrote")
        self._put_bytes(_manifest_key(snapshot_id), data)

    def get_manifest(self, snapshot_id: str) -> bytes:
        check_id(snapshot_id, "snapshot")
        try:
            data = self._get_retrying(_manifest_key(snapshot_id), f"snapshot {snapshot_id}")
        except NoSuchBucket:
            raise
        except NotFound:
            raise NotFound(f"snapshot {snapshot_id} not found in {self.uri} "
                           f"(try 'warmstart ls --store {self.uri}')") from None
        if blob_id(data) != snapshot_id:
            raise CorruptBlob(f"the manifest of snapshot {snapshot_id} in {self.uri} does not match its id; "
                              "push the snapshot again")
        return data

    def has_manifest(self, snapshot_id: str) -> bool:
        check_id(snapshot_id, "snapshot")
        return self._size(_manifest_key(snapshot_id)) is not None

    def list_snapshots(self) -> list[str]:
        names = (name.removesuffix(MANIFEST_SUFFIX) for name, _, _ in self._list("snapshots/")
                 if name.endswith(MANIFEST_SUFFIX))
        return sorted(name for name in names if is_id(name))

    # Refs.
    def set_ref(self, name: str, snapshot_id: str) -> None:
        check_new_ref_name(name)
        check_id(snapshot_id, "snapshot")
        if not self.has_manifest(snapshot_id):
            raise NotFound(f"cannot point ref {name!r} at snapshot {snapshot_id}: it is not in {self.uri} "
                           "(push it first)")
        self._put_bytes(_ref_key(name), f"{snapshot_id}\n".encode())

    def get_ref(self, name: str) -> str:
        target = self._ref_content(name)
        if not is_id(target):
            raise StoreError(self._bad_ref(name, target))
        return target

    def list_refs(self) -> dict[str, str]:
        return {name: self.get_ref(name) for name in self._ref_names()}

    def survey_refs(self) -> tuple[dict[str, str], dict[str, str]]:
        """Every ref, without stopping at a bad one: ({name: snapshot id}, {name: what is wrong with it}) for the
        refs that hold a snapshot id and those that do not. A ref deleted meanwhile is in neither."""
        good: dict[str, str] = {}
        bad: dict[str, str] = {}
        for name in self._ref_names():
            try:
                target = self._ref_content(name)
            except NoSuchBucket:
                raise
            except NotFound:
                continue
            if is_id(target):
                good[name] = target
            else:
                bad[name] = self._bad_ref(name, target)
        return good, bad

    # LoRA adapters pushed against a snapshot: a ref-like pointer at the blob of the adapter's document.
    def set_lora(self, snapshot_id: str, name: str, document: str) -> None:
        """Point adapter ``name`` of snapshot ``snapshot_id`` at the blob ``document`` (written last by a push)."""
        check_id(snapshot_id, "snapshot")
        check_id(document)
        check_ref_name(name)
        if not self.has_manifest(snapshot_id):
            raise NotFound(f"cannot add LoRA adapter {name!r} to snapshot {snapshot_id}: it is not in {self.uri}")
        if not self.has_blob(document):
            raise NotFound(f"cannot point LoRA adapter {name!r} at blob {document}: it is not in {self.uri}")
        self._put_bytes(_lora_key(snapshot_id, name), f"{document}\n".encode())

    def get_lora(self, snapshot_id: str, name: str) -> str:
        """The blob id of the document of adapter ``name`` pushed against the snapshot; NotFound when none was."""
        check_id(snapshot_id, "snapshot")
        check_ref_name(name)
        what = f"LoRA adapter {name!r} of snapshot {snapshot_id}"
        try:
            raw = self._get_retrying(_lora_key(snapshot_id, name), what)
        except NoSuchBucket:
            raise
        except NotFound:
            pushed = sorted(n for s, n in self.list_loras() if s == snapshot_id)
            raise NotFound(f"no {what} in {self.uri} (pushed against it: {', '.join(pushed) or 'none'}; push one "
                           f"with `warmstart lora push NAME=DIR --snapshot {snapshot_id}`)") from None
        target = raw.decode("utf-8", "replace").strip()
        if not is_id(target):
            raise StoreError(f"{what} in {self.uri} does not hold a blob id ({len(raw)} bytes that are not one; "
                             "what they say is not repeated here); push it again")
        return target

    def list_loras(self) -> dict[tuple[str, str], str]:
        """{(snapshot id, adapter name): document blob id} of every adapter pushed against a snapshot; pointers
        that cannot be read are left out."""
        out: dict[tuple[str, str], str] = {}
        for key, _, _ in self._list("loras/"):
            snapshot_id, dot, name = key.partition(".")
            if not dot or not is_id(snapshot_id) or not is_ref_name(name):
                continue
            try:
                target = self._get_retrying(_lora_key(snapshot_id, name), f"LoRA adapter {name!r}").decode().strip()
            except NoSuchBucket:
                raise
            except (NotFound, UnicodeDecodeError):
                continue
            if is_id(target):
                out[(snapshot_id, name)] = target
        return out

    def _ref_names(self) -> list[str]:
        return sorted(name for name, _, _ in self._list("refs/") if is_ref_name(name))

    def _ref_content(self, name: str) -> str:
        """What the ref holds, stripped: a snapshot id unless someone wrote something else there."""
        check_ref_name(name)
        try:
            raw = self._get_retrying(_ref_key(name), f"ref {name!r}")
        except NoSuchBucket:
            raise
        except NotFound:
            raise NotFound(f"ref {name!r} not found in {self.uri} (try 'warmstart ls --store {self.uri}')") from None
        return raw.decode("utf-8", "replace").strip()

    def _bad_ref(self, name: str, content: str) -> str:
        # never what it holds: a pointer replaced by someone else's file must not be read out through an error
        return (f"ref {name!r} in {self.uri} does not hold a snapshot id ({len(content)} characters that are not "
                "one); point it again with 'warmstart tag'")

    def delete_ref(self, name: str) -> None:
        check_ref_name(name)
        if self._size(_ref_key(name)) is None:
            raise NotFound(f"ref {name!r} not found in {self.uri}")
        self._delete(_ref_key(name))

    # KV tier segments (runtime/engine/kv_tier.py): named by scope and chain, not by content, under kv/.
    def put_kv_segment(self, name: str, data: bytes) -> None:
        self._put_bytes(_kv_key(name), data)

    def get_kv_segment(self, name: str) -> bytes | None:
        """The segment, or None when there is none (a missing bucket is an error, not a miss)."""
        try:
            return self._get_bytes(_kv_key(name), f"KV segment {name}")
        except NoSuchBucket:
            raise
        except NotFound:
            return None

    def _get_retrying(self, key: str, what: str) -> bytes:
        """The whole object, read again when the connection drops mid-body, as blob parts are."""
        attempt = 0
        while True:
            try:
                return self._get_bytes(key, what)
            except TransferInterrupted as e:
                attempt += 1
                if attempt > retry.RETRIES:
                    raise
                log.debug("%s: reading again (attempt %d): %s", what, attempt + 1, e)
                retry.pause_before_retry(attempt)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def _blob_key(blob: str) -> str:
    return f"blobs/{blob}"


def _manifest_key(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}{MANIFEST_SUFFIX}"


def _ref_key(name: str) -> str:
    return f"refs/{name}"


_KV_NAME = re.compile(r"^[0-9A-Za-z._-]+(/[0-9A-Za-z._-]+)*$")


def _kv_key(name: str) -> str:
    if not _KV_NAME.match(name) or any(part in (".", "..") for part in name.split("/")):
        raise ValueError(f"not a KV segment name: {name[:200]!r}")
    return f"kv/{name}"


def _lora_key(snapshot_id: str, name: str) -> str:
    return f"loras/{snapshot_id}.{name}"


def is_ref_name(name: str) -> bool:
    try:
        check_ref_name(name)
    except StoreError:
        return False
    return True


class LocalStore(Store):
    """A store in a local directory; every write is atomic (temporary file, fsync, rename)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        """The file of ``key``; a link (the key's or a folder's) that leads out of the store is refused, so that a
        pointer replaced by a link to /etc/passwd is never read, nor a write sent outside through a linked folder."""
        path = self.root / key
        real, root = os.path.realpath(path), os.path.realpath(self.root)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise StoreError(f"{key} in the store {self.uri} is a link that leads out of the store, which it does not "
                             "follow; remove the link (or copy the file in its place)")
        return path

    def _size(self, key: str) -> int | None:
        with os_errors(f"reading the store {self.uri}"):
            try:
                return self._path(key).stat().st_size
            except (FileNotFoundError, NotADirectoryError):
                return None

    def _put_file(self, key: str, path: Path, on_bytes: OnBytes | None, checksum: str | None = None) -> None:
        with os_errors(f"writing {key} into the store {self.uri}"):
            write_atomic(self._path(key), lambda f: copy_into(f, path, on_bytes))

    def _put_bytes(self, key: str, data: bytes) -> None:
        with os_errors(f"writing {key} into the store {self.uri}"):
            write_atomic(self._path(key), lambda f: write_all(f, data))

    def _get_bytes(self, key: str, what: str) -> bytes:
        with os_errors(f"reading {what} from the store {self.uri}"):
            try:
                return self._path(key).read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                raise NotFound(f"{what} not found in {self.uri}") from None

    def _stream(self, key: str, start: int, end: int, what: str) -> Iterator[bytes]:
        with os_errors(f"reading {what} from the store {self.uri}"):
            try:
                f = open(self._path(key), "rb")  # noqa: SIM115 (closed below, after the last piece)
            except (FileNotFoundError, NotADirectoryError):
                raise NotFound(f"{what} not found in {self.uri}") from None
            with f:
                f.seek(start)
                pos = start
                while pos < end and (chunk := f.read(min(CHUNK, end - pos))):
                    pos += len(chunk)
                    yield chunk

    def _list(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        with os_errors(f"listing the store {self.uri}"):
            try:
                entries = list(os.scandir(self._path(prefix)))
            except (FileNotFoundError, NotADirectoryError):
                return
            for entry in entries:
                with suppress(FileNotFoundError):  # deleted since the scan
                    if entry.is_file(follow_symlinks=False):
                        st = entry.stat()
                        yield entry.name, st.st_size, st.st_mtime

    def _delete(self, key: str) -> None:
        with os_errors(f"deleting {key} from the store {self.uri}"):
            self._path(key).unlink(missing_ok=True)

    def _blob_matches(self, key: str, blob: str, size: int) -> bool | None:
        # A local file has no checksum beside it, so it is hashed: a read from local disk, cheaper than the copy
        # that replacing it would cost.
        with os_errors(f"checking {key} in the store {self.uri}"):
            try:
                if self._path(key).stat().st_size != size:
                    return False
                return file_blob_id(self._path(key)) == blob
            except (FileNotFoundError, NotADirectoryError):
                return None

    def _touch(self, key: str, blob: str) -> bool:
        with self._ages_lock(exclusive=False), os_errors(f"refreshing {key} in the store {self.uri}"):
            try:
                os.utime(self._path(key))
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                return False  # gone, or another user's file: the caller writes a fresh copy, as young
            return True

    def _delete_if_older(self, key: str, cutoff: float) -> bool:
        with self._ages_lock(exclusive=True), os_errors(f"deleting {key} from the store {self.uri}"):
            try:
                if self._path(key).stat().st_mtime >= cutoff:
                    return False
                self._path(key).unlink()
            except (FileNotFoundError, NotADirectoryError):
                return False
            return True

    @contextmanager
    def _ages_lock(self, exclusive: bool) -> Iterator[None]:
        """Between pushes refreshing blobs (shared) and gc judging a blob's age and deleting it (exclusive): gc then
        sees a refreshed blob as young, or deletes it before the refresh, which then fails and uploads it again."""
        with os_errors(f"locking the store {self.uri}"):
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / ".gc-lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            with os_errors(f"locking the store {self.uri}"):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                except OSError as e:
                    if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    log.debug("the store %s cannot be locked (%s); gc and pushes are not serialized", self.uri, e)
            yield
        finally:
            os.close(fd)  # closing drops the lock
