"""A snapshot manifest's adapters, LoRA adapters and "auto" selector, summarized for `warmstart inspect` and the
server's info."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warmstart.snapshot.manifest_view import ManifestView


def adapter_summaries(m: ManifestView) -> list[dict[str, Any]]:
    return [{"name": a.name, "kind": a.kind, "virtual_tokens": a.num_virtual_tokens, "wasted_slots": a.wasted_slots}
            for a in m.adapters]


def lora_summaries(m: ManifestView) -> list[dict[str, Any]]:
    """The LoRA adapters stored as their own blobs (`warmstart build --lora NAME=DIR`, snapshot/lora.py)."""
    return [{"name": a.name, "rank": a.rank, "blob": a.blob, "bytes": m.blobs[a.blob], "base_model": a.base_model}
            for a in m.loras]


def selector_summary(m: ManifestView) -> dict[str, Any] | None:
    s = m.adapter_selector
    return None if s is None else {"adapters": list(s.names), "held_out": s.held_out, "accuracy": s.accuracy}
