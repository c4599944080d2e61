"""How a read whose connection dropped while the body streamed is tried again: botocore retries whole requests
(5xx, throttling, refused connections) but not a body cut off midway, so the readers of blob parts, manifests
and refs do that themselves, with this policy."""

from __future__ import annotations

import random
import time

RETRIES = 5  # reads again after the first, per blob part, manifest or ref
BACKOFF_SECONDS = 0.2  # before the first retry; doubled for each next one, with jitter


def pause_before_retry(attempt: int) -> None:
    """Sleep before retry number ``attempt`` (1 for the first)."""
    time.sleep(BACKOFF_SECONDS * 2 ** (attempt - 1) * (0.5 + random.random()))
