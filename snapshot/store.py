"""Stores hold snapshots: blobs named by their content hash, manifests named by the snapshot id, and refs.

The layout is the same in every kind of store, relative to its root:

    blobs/<id>                  immutable bytes; id = xxh3-128 of the content
    snapshots/<id>.msgpack      a manifest; id = xxh3-128 of these bytes (the snapshot id)
    refs/<name>                 text: a snapshot id (refs are the only thing ever overwritten)

Two kinds: a local directory (a plain path or file://PATH) and S3 or any S3-compatible endpoint
(s3://BUCKET/PREFIX) through boto3. `Store` holds the layout and the checks; a kind only moves bytes by key.
Every failure is a StoreError whose message is one sentence saying what was wrong and what to do.
Credentials never appear in a message or a log line.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

from snapshot.format import blob_id, file_blob_id, is_id

MAX_REF_LENGTH = 128
REF_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
MANIFEST_SUFFIX = ".msgpack"
CHUNK = 8 << 20  # copy and stream in pieces this large

OnBytes = Callable[[int], None]


class StoreError(Exception):
    """A store operation failed; the message is one sentence: what was wrong and what to do."""


class NotFound(StoreError):
    """The blob, snapshot, ref or bucket does not exist."""


class NoSuchBucket(NotFound):
    """The bucket itself does not exist (so nothing in it can be found either)."""


class AccessDenied(StoreError):
    """Missing, rejected or insufficient credentials or permissions."""


class StoreUnreachable(StoreError):
    """The store could not be reached, or kept failing after retries; trying again later may work."""


class TransferInterrupted(StoreUnreachable):
    """The connection failed while a body was streaming (botocore retries requests, not bodies); what arrived
    is good, so the reader may resume from there."""


class CorruptBlob(StoreError):
    """Bytes that do not hash to the id they are stored under."""


def user_cache_dir() -> Path:
    """warmstart's directory under the user's cache ($XDG_CACHE_HOME or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "warmstart"


def default_store_dir() -> Path:
    return Path(os.environ.get("WARMSTART_STORE") or user_cache_dir() / "store").expanduser()


def open_store(uri: str | None = None) -> Store:
    """The store at ``uri``: a directory, file://PATH or s3://BUCKET/PREFIX; None means the default local store
    ($WARMSTART_STORE or ~/.cache/warmstart/store). $WARMSTART_STORE may itself be an s3:// URI."""
    if uri is None:
        uri = os.environ.get("WARMSTART_STORE") or str(default_store_dir())
    if not uri.strip():
        raise StoreError("the store URI is empty; give a directory, file://PATH or s3://BUCKET/PREFIX")
    scheme = urlparse(uri).scheme
    if scheme == "s3":
        return S3Store(uri)
    if scheme == "file":
        return LocalStore(_file_uri_path(uri))
    if scheme and len(scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise StoreError(f"unsupported store URI scheme {scheme!r}; give a directory, file://PATH or s3://BUCKET/PREFIX")
    return LocalStore(uri)


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
    def _put_file(self, key: str, path: Path, on_bytes: OnBytes | None) -> None: ...

    @abstractmethod
    def _put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _get_bytes(self, key: str, what: str) -> bytes:
        """The whole object; raises NotFound naming ``what`` when it does not exist."""

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

    # Blobs.
    def has_blob(self, blob: str) -> bool:
        check_id(blob)
        return self._size(_blob_key(blob)) is not None

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
        self._put_file(_blob_key(blob), path, on_bytes)

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
            data = self._get_bytes(_manifest_key(snapshot_id), f"snapshot {snapshot_id}")
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
        check_ref_name(name)
        check_id(snapshot_id, "snapshot")
        if not self.has_manifest(snapshot_id):
            raise NotFound(f"cannot point ref {name!r} at snapshot {snapshot_id}: it is not in {self.uri} "
                           "(push it first)")
        self._put_bytes(_ref_key(name), f"{snapshot_id}\n".encode())

    def get_ref(self, name: str) -> str:
        check_ref_name(name)
        try:
            raw = self._get_bytes(_ref_key(name), f"ref {name!r}")
        except NoSuchBucket:
            raise
        except NotFound:
            raise NotFound(f"ref {name!r} not found in {self.uri} (try 'warmstart ls --store {self.uri}')") from None
        target = raw.decode("utf-8", "replace").strip()
        if not is_id(target):
            raise StoreError(f"ref {name!r} in {self.uri} does not hold a snapshot id; "
                             "point it again with 'warmstart tag'")
        return target

    def list_refs(self) -> dict[str, str]:
        names = sorted(name for name, _, _ in self._list("refs/") if is_ref_name(name))
        return {name: self.get_ref(name) for name in names}

    def delete_ref(self, name: str) -> None:
        check_ref_name(name)
        if self._size(_ref_key(name)) is None:
            raise NotFound(f"ref {name!r} not found in {self.uri}")
        self._delete(_ref_key(name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def _blob_key(blob: str) -> str:
    return f"blobs/{blob}"


def _manifest_key(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}{MANIFEST_SUFFIX}"


def _ref_key(name: str) -> str:
    return f"refs/{name}"


def is_ref_name(name: str) -> bool:
    try:
        check_ref_name(name)
    except StoreError:
        return False
    return True


def _file_uri_path(uri: str) -> str:
    parsed = urlparse(uri)
    if parsed.netloc not in ("", "localhost"):
        raise StoreError(f"file URI {uri!r} names host {parsed.netloc!r}; write file:///ABSOLUTE/PATH or a plain path")
    if not parsed.path:
        raise StoreError(f"file URI {uri!r} has no path; write file:///ABSOLUTE/PATH or a plain path")
    return parsed.path


# Local files ----------------------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, fill: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through a temporary file in the same directory (fsync, then rename), so that readers see
    the old content or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"  # names starting with '.' are never listed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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


class LocalStore(Store):
    """A store in a local directory; every write is atomic (temporary file, fsync, rename)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def _size(self, key: str) -> int | None:
        with os_errors(f"reading the store {self.uri}"):
            try:
                return self._path(key).stat().st_size
            except (FileNotFoundError, NotADirectoryError):
                return None

    def _put_file(self, key: str, path: Path, on_bytes: OnBytes | None) -> None:
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


# S3 -------------------------------------------------------------------------------------------------------

MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 32 << 20
MAX_ATTEMPTS = 8  # unless configured: botocore retries throttling, 5xx and dropped connections with backoff

BUCKET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_ACCESS_DENIED = {"AccessDenied", "AllAccessDisabled", "Forbidden", "403", "AccountProblem"}
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "TokenRefreshRequired", "InvalidClientTokenId", "UnrecognizedClientException"}
_MISSING = {"NoSuchKey", "404", "NotFound"}
_WRONG_REGION = {"AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException"}
_BUSY = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable", "InternalError",
         "RequestLimitExceeded", "TooManyRequests", "503", "500", "502", "504"}
# Query parameters of presigned URLs, and anything that looks like an AWS access key id.
_SECRET_PATTERNS = re.compile(r"(X-Amz-(Credential|Signature|Security-Token)=[^&\s\"']*)|\b(AKIA|ASIA)[A-Z0-9]{12,}\b",
                              re.IGNORECASE)


class S3Store(Store):
    """A store in an S3 bucket (or an S3-compatible one: MinIO, R2...) under an optional key prefix.

    Credentials, region and endpoint come from the standard AWS configuration (environment, profile, config
    file, instance role; AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 for other endpoints): nothing is passed here.
    """

    def __init__(self, uri: str, *, client: Any = None, transfer_config: Any = None) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError

        parsed = urlparse(uri)
        if parsed.scheme != "s3":
            raise StoreError(f"{uri!r} is not an s3:// URI; write s3://BUCKET/PREFIX")
        self.bucket = parsed.netloc
        if "@" in uri or ":" in self.bucket:
            # The URI may hold a secret (s3://KEY:SECRET@bucket): do not repeat any of it.
            raise StoreError("an s3:// URI takes no credentials; write s3://BUCKET/PREFIX and configure credentials "
                             "through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
        if not self.bucket:
            raise StoreError(f"{uri!r} names no bucket; write s3://BUCKET/PREFIX")
        if not BUCKET_NAME.match(self.bucket):
            raise StoreError(f"{self.bucket[:70]!r} is not a bucket name (letters, digits, '.' and '-')")
        self.prefix = parsed.path.strip("/")
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        try:
            self._session = boto3.session.Session()
            configured = self._session._session.get_config_variable  # AWS_RETRY_MODE, AWS_MAX_ATTEMPTS, profile
            retries = {"mode": configured("retry_mode") or "standard",
                       "total_max_attempts": configured("max_attempts") or MAX_ATTEMPTS}
            self.client = client or self._session.client("s3", config=Config(
                retries=retries,
                max_pool_connections=64,  # parallel ranged GETs and multipart uploads share this client
                connect_timeout=5,
                read_timeout=60,
            ))
        except (BotoCoreError, ValueError) as e:
            raise StoreError(f"cannot set up S3 access for {self.uri}: {self._redact(str(e))}") from None
        self.transfer_config = transfer_config or TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK, max_concurrency=8)

    @property
    def endpoint(self) -> str:
        """The endpoint URL, without any user info or query."""
        url = urlparse(str(self.client.meta.endpoint_url))
        return f"{url.scheme}://{url.hostname}" + (f":{url.port}" if url.port else "")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _size(self, key: str) -> int | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:
            error = self._error(e, key)
            if isinstance(error, NotFound) and not isinstance(error, NoSuchBucket):
                return None
            raise error from None
        return int(head["ContentLength"])

    def _put_file(self, key: str, path: Path, on_bytes: OnBytes | None) -> None:
        try:
            self.client.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer_config,
                                    Callback=on_bytes)
        except Exception as e:
            # boto3 wraps client errors of uploads in S3UploadFailedError; the original is its context.
            cause = e.__cause__ or e.__context__
            raise self._error(cause if type(e).__name__ == "S3UploadFailedError" and cause else e, key) from None

    def _put_bytes(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as e:
            raise self._error(e, key) from None

    def _get_bytes(self, key: str, what: str) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return bytes(response["Body"].read())
        except Exception as e:
            raise self._error(e, what) from None

    def _stream(self, key: str, start: int, end: int, what: str) -> Iterator[bytes]:
        if end == start:
            return
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}")
        except Exception as e:
            error = self._error(e, what)
            if getattr(e, "response", {}).get("Error", {}).get("Code") == "InvalidRange":
                return  # the range starts past the stored object's end: it is shorter than asked
            raise error from None
        body = response["Body"]
        if int(response.get("ContentLength", 0)) > end - start:
            body.close()
            raise StoreError(f"{self.endpoint} ignored the byte range asked for {what}; "
                             "the endpoint must support ranged GETs")
        try:
            # botocore checks the received length against Content-Length: a cut body raises, never ends quietly.
            yield from body.iter_chunks(1 << 20)
        except Exception as e:
            error = self._error(e, what)
            if type(error) is StoreUnreachable:
                raise TransferInterrupted(str(error)) from None
            raise error from None
        finally:
            body.close()

    def _list(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        full = self._key(prefix)
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(full):]
                    if name and "/" not in name:
                        yield name, int(obj["Size"]), obj["LastModified"].timestamp()
        except Exception as e:
            raise self._error(e, f"the listing of {prefix.rstrip('/')}") from None

    def _delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:
            raise self._error(e, key) from None

    def _error(self, e: BaseException, what: str) -> StoreError:
        """One clear StoreError for whatever boto3 raised; never the raw message (it might carry secrets)."""
        from botocore import exceptions as bx

        if isinstance(e, StoreError):
            return e
        if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError | bx.CredentialRetrievalError):
            return AccessDenied(f"no usable AWS credentials for {self.uri}; set AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where an instance role is available")
        if isinstance(e, bx.EndpointConnectionError | bx.ConnectTimeoutError | bx.ProxyConnectionError):
            return StoreUnreachable(f"cannot reach the S3 endpoint {self.endpoint} for {self.uri}; check the network "
                                    "and AWS_ENDPOINT_URL")
        if isinstance(e, bx.ConnectionError | bx.HTTPClientError | bx.IncompleteReadError | ConnectionError):
            return StoreUnreachable(f"the connection to {self.endpoint} failed while reading {what} from {self.uri} "
                                    f"({type(e).__name__}); try again")
        if isinstance(e, bx.ParamValidationError):
            return StoreError(f"{self.uri} is not a valid S3 location (check the bucket name)")
        if isinstance(e, bx.ClientError):
            return self._client_error(e, what)
        if isinstance(e, bx.BotoCoreError):
            return StoreError(f"S3 request for {what} in {self.uri} failed: {self._redact(str(e))}")
        return StoreError(f"S3 request for {what} in {self.uri} failed ({type(e).__name__})")

    def _client_error(self, e: Any, what: str) -> StoreError:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code == "NoSuchBucket":
            return NoSuchBucket(f"bucket {self.bucket!r} does not exist at {self.endpoint}; "
                                "create it or fix the store URI")
        if code in _MISSING or status == 404:
            return NotFound(f"{what} not found in {self.uri}")
        if code in _BAD_CREDENTIALS:
            return AccessDenied(f"{self.endpoint} rejected the AWS credentials ({code}); check AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
        if code in _ACCESS_DENIED or status == 403:
            return AccessDenied(f"access to {what} in {self.uri} was denied ({code or status}); the credentials need "
                                "s3:GetObject, s3:PutObject, s3:ListBucket and s3:DeleteObject on that bucket")
        if code in _WRONG_REGION or status == 301:
            return StoreError(f"bucket {self.bucket!r} is in another region than the configured one ({code}); "
                              "set AWS_REGION to the bucket's region")
        if code in _BUSY or status >= 500:
            return StoreUnreachable(f"{self.endpoint} kept failing ({code or status}) for {what} in {self.uri} "
                                    "after retries; try again later")
        return StoreError(f"S3 refused {what} in {self.uri} ({code or 'HTTP'} {status})")

    def _redact(self, text: str) -> str:
        """``text`` with the current credentials and anything shaped like a key or a presigned URL removed."""
        with suppress(Exception):
            creds = self._session.get_credentials()
            if creds is not None:
                frozen = creds.get_frozen_credentials()
                for secret in (frozen.access_key, frozen.secret_key, frozen.token):
                    if secret:
                        text = text.replace(secret, "***")
        return _SECRET_PATTERNS.sub("***", text)
