"""The store factory: a store URI (a directory, file://PATH or s3://BUCKET/PREFIX) to its Store."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from warmstart.snapshot.errors import StoreError
from warmstart.snapshot.s3 import BULK, S3Store, Timeouts
from warmstart.snapshot.store import LocalStore, Store, default_store_dir


def open_store(uri: str | None = None, timeouts: Timeouts = BULK) -> Store:
    """The store at ``uri``: a directory, file://PATH or s3://BUCKET/PREFIX; None means the default local store
    ($WARMSTART_STORE or ~/.cache/warmstart/store). $WARMSTART_STORE may itself be an s3:// URI. ``timeouts``
    bound each call to an S3 store (snapshot/s3.py)."""
    if uri is None:
        uri = os.environ.get("WARMSTART_STORE") or str(default_store_dir())
    if not uri.strip():
        raise StoreError("the store URI is empty; give a directory, file://PATH or s3://BUCKET/PREFIX")
    scheme = urlparse(uri).scheme
    if scheme == "s3":
        return S3Store(uri, timeouts=timeouts)
    if scheme == "file":
        return LocalStore(_file_uri_path(uri))
    if scheme and len(scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise StoreError(f"unsupported store URI scheme {scheme!r}; give a directory, file://PATH or s3://BUCKET/PREFIX")
    return LocalStore(uri)


def _file_uri_path(uri: str) -> str:
    parsed = urlparse(uri)
    if parsed.netloc not in ("", "localhost"):
        raise StoreError(f"file URI {uri!r} names host {parsed.netloc!r}; write file:///ABSOLUTE/PATH or a plain path")
    if not parsed.path:
        raise StoreError(f"file URI {uri!r} has no path; write file:///ABSOLUTE/PATH or a plain path")
    return parsed.path
