"""A store in S3 or an S3-compatible endpoint, through boto3; every botocore failure becomes one StoreError
that never repeats a credential."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from warmstart.snapshot.errors import (
    AccessDenied,
    NoSuchBucket,
    NotFound,
    StoreError,
    StoreUnreachable,
    TransferInterrupted,
)
from warmstart.snapshot.files import OnBytes
from warmstart.snapshot.store import Store

MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 32 << 20
CHECKSUM_METADATA = "xxh3"  # user metadata (x-amz-meta-xxh3) where a push stores a blob's id, its xxh3-128
MAX_ATTEMPTS = 8  # unless configured: botocore retries throttling, 5xx and dropped connections with backoff


@dataclass(frozen=True)
class Timeouts:
    """How long one S3 call may take: connecting, waiting for each read, and attempts in all."""

    connect: float = 5.0
    read: float = 60.0  # a multi-GB snapshot's part on a slow link
    attempts: int | None = None  # None: AWS_MAX_ATTEMPTS, else MAX_ATTEMPTS


BULK = Timeouts()
# The KV tier's calls serve a request that waits at most 2 s for its segments (runtime/engine/kv_tier.py), and a
# process that stops must not sit in a 60-second read behind them.
REQUEST_SIZED = Timeouts(connect=1.0, read=2.0, attempts=2)

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

    def __init__(self, uri: str, *, client: Any = None, transfer_config: Any = None,
                 timeouts: Timeouts = BULK) -> None:
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
                       "total_max_attempts": timeouts.attempts or configured("max_attempts") or MAX_ATTEMPTS}
            self.client = client or self._session.client("s3", config=Config(
                retries=retries,
                max_pool_connections=64,  # parallel ranged GETs and multipart uploads share this client
                connect_timeout=timeouts.connect,
                read_timeout=timeouts.read,
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
        head = self._head(key)
        return None if head is None else int(head["ContentLength"])

    def _head(self, key: str) -> dict[str, Any] | None:
        """The object's HEAD response (size, last-modified, user metadata), or None when it does not exist."""
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=self._key(key)))
        except Exception as e:
            error = self._error(e, key)
            if isinstance(error, NotFound) and not isinstance(error, NoSuchBucket):
                return None
            raise error from None

    def _put_file(self, key: str, path: Path, on_bytes: OnBytes | None, checksum: str | None = None) -> None:
        extra = {"Metadata": {CHECKSUM_METADATA: checksum}} if checksum else None
        try:
            self.client.upload_file(str(path), self.bucket, self._key(key), ExtraArgs=extra,
                                    Config=self.transfer_config, Callback=on_bytes)
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
        except Exception as e:
            raise self._error(e, what) from None
        try:
            return bytes(response["Body"].read())
        except Exception as e:
            error = self._error(e, what)
            if type(error) is StoreUnreachable:  # cut mid-body: botocore retried the request, not the body
                raise TransferInterrupted(str(error)) from None
            raise error from None
        finally:
            response["Body"].close()

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

    def _blob_matches(self, key: str, blob: str, size: int) -> bool | None:
        # The checksum is the blob's id, stored by the push that uploaded it: one HEAD, nothing read. An object
        # without it (overwritten by another tool, or pushed by a warmstart before it kept one) counts as damaged.
        head = self._head(key)
        if head is None:
            return None
        return int(head["ContentLength"]) == size and head.get("Metadata", {}).get(CHECKSUM_METADATA) == blob

    def _touch(self, key: str, blob: str) -> bool:
        # S3 changes LastModified only on a write: a copy onto itself (server-side; S3 refuses one that changes
        # nothing, hence the metadata written again). In a versioned bucket this keeps one more version.
        source = {"Bucket": self.bucket, "Key": self._key(key)}
        try:
            self.client.copy(source, self.bucket, self._key(key), Config=self.transfer_config,
                             ExtraArgs={"MetadataDirective": "REPLACE", "Metadata": {CHECKSUM_METADATA: blob}})
        except Exception as e:
            error = self._error(e, key)
            if isinstance(error, NotFound) and not isinstance(error, NoSuchBucket):
                return False
            raise error from None
        return True

    def _delete_if_older(self, key: str, cutoff: float) -> bool:
        # Not atomic: a refresh landing between this HEAD and the DELETE is lost (S3's conditional deletes match an
        # ETag, which a self-copy keeps, or a modification time, on directory buckets only). A push re-checks its
        # blobs after refreshing them, which leaves that one request's window.
        head = self._head(key)
        if head is None or head["LastModified"].timestamp() >= cutoff:
            return False
        self._delete(key)
        return True

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
