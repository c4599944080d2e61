"""Ignored request fields are counted by name in /metrics, with the names a label can take capped."""

from __future__ import annotations

from warmstart.handlers.server.metrics import MAX_IGNORED_NAMES, Metrics
from warmstart.handlers.server.timeline import cold_start_timeline


def counts(metrics: Metrics) -> dict[str, float]:
    out = {}
    for line in metrics.render(None).decode().splitlines():
        if line.startswith("warmstart:request_ignored_fields_total{"):
            field = line.split('field="', 1)[1].split('"', 1)[0]
            out[field] = float(line.split()[-1])
    return out


def test_ignored_fields_are_counted_and_clients_cannot_grow_the_series() -> None:
    metrics = Metrics("m", cold_start_timeline())
    metrics.count_ignored(["prompt_cache_key", "reasoning_effort"])
    metrics.count_ignored(["prompt_cache_key"])
    assert counts(metrics) == {"prompt_cache_key": 2.0, "reasoning_effort": 1.0}
    metrics.count_ignored([f"made_up_{i}" for i in range(100)] + ["x" * 1000])
    seen = counts(metrics)
    assert len(seen) == MAX_IGNORED_NAMES + 1 and seen["_other"] == 100 - (MAX_IGNORED_NAMES - 2) + 1
    metrics.count_ignored(["prompt_cache_key"])  # a name seen before the cap keeps its own series
    assert counts(metrics)["prompt_cache_key"] == 3.0
