"""What can go wrong with a store or the cache: one exception per kind of failure a caller may act on.

Every message is one sentence saying what was wrong and what to do; none holds a credential.
"""

from __future__ import annotations


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


class BuildError(Exception):
    """Something in a build's inputs that the user must fix; the message says what."""
