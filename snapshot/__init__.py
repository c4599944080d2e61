"""Snapshots: format, stores (local directory, S3), local cache, build pipeline and loader.

``snapshot.load(ref, store=..., cache=..., **engine_options)`` returns a ready ``runtime.LLM``. It is
imported on first use, so that listing or pulling from a store never imports torch.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "load":
        from warmstart.snapshot.loader import load

        return load
    raise AttributeError(f"module 'snapshot' has no attribute {name!r}")
