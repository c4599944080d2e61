"""/metrics' LoRA families from the engine's LoraStats (runtime/engine/lora.py): page-in load errors are counted."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from warmstart.handlers.server.metrics import Metrics
from warmstart.handlers.server.timeline import cold_start_timeline
from warmstart.runtime.engine.lora import LoraStats


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_load_errors_are_a_counter() -> None:
    metrics = Metrics("base", cold_start_timeline())
    stats = LoraStats(hits=5, misses=2, loads=2, load_seconds=0.25, load_errors=3, last_load_error="blob gone")
    values = samples(metrics.render(None, stats).decode())
    assert values["warmstart:lora_load_errors_total"] == 3
    assert values["warmstart:lora_cache_misses_total"] == 2


def test_no_lora_families_without_lora_stats() -> None:
    values = samples(Metrics("base", cold_start_timeline()).render(None).decode())
    assert not any(name.startswith("warmstart:lora_") for name in values)
