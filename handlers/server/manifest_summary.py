"""A snapshot manifest's adapters, LoRA adapters and "auto" selector, summarized for `warmstart inspect` and the
server's info."""

from __future__ import annotations

from typing import Any


def adapter_summaries(m: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": a["name"], "kind": a["kind"], "virtual_tokens": a["num_virtual_tokens"],
             "wasted_slots": a["wasted_slots"]} for a in m.get("adapters", [])]


def lora_summaries(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The LoRA adapters stored as their own blobs (`warmstart build --lora NAME=DIR`, snapshot/lora.py)."""
    return [{"name": a["name"], "rank": a["rank"], "blob": a["blob"], "bytes": m["blobs"][a["blob"]],
             "base_model": a.get("base_model")} for a in m.get("loras", [])]


def selector_summary(m: dict[str, Any]) -> dict[str, Any] | None:
    s = m.get("adapter_selector")
    return None if s is None else {"adapters": s["names"], "held_out": s["held_out"], "accuracy": s["accuracy"]}
