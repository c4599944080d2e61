"""benchmarks/bench_serve.py without vLLM: reading `vllm bench serve`'s result JSON (a real one, from vllm serve
at 2 req/s with the shared prefix), the per-round ratios and the table, the prefix cache counters of both servers'
/metrics, and the tester's command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_serve import (
    WORKLOADS,
    bench_command,
    format_table,
    prefix_cache_tokens,
    problems,
    report_workload,
    summarize,
)

RESULT = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_bench_serve_result.json"


def row(output_tok_s: float, ttft_ms: float, tpot_ms: float, failed: int = 0) -> dict[str, Any]:
    return {"output_tok_s": output_tok_s, "request_s": output_tok_s / 128, "ttft_p50_ms": ttft_ms,
            "ttft_p99_ms": 2 * ttft_ms, "tpot_p50_ms": tpot_ms, "completed": 48 - failed, "failed": failed,
            "input_tokens": 48 * 512, "output_tokens": (48 - failed) * 128, "first_errors": []}


def test_summarize_reads_the_testers_result_json() -> None:
    result = json.loads(RESULT.read_text())
    r = summarize(result)
    assert r["output_tok_s"] == pytest.approx(result["output_throughput"])
    assert r["request_s"] == pytest.approx(result["request_throughput"])
    assert r["ttft_p50_ms"] == pytest.approx(result["p50_ttft_ms"])
    assert r["ttft_p99_ms"] == pytest.approx(result["p99_ttft_ms"])
    assert r["tpot_p50_ms"] == pytest.approx(result["p50_tpot_ms"])
    assert (r["completed"], r["failed"], r["output_tokens"]) == (8, 0, 1024)
    assert r["first_errors"] == [] and problems(r, 8 * 128) == []


def test_summarize_says_which_keys_are_missing_and_how_to_get_them() -> None:
    result = json.loads(RESULT.read_text())
    del result["p99_ttft_ms"]
    with pytest.raises(ValueError, match=r"p99_ttft_ms.*--metric-percentiles 50,99"):
        summarize(result)


def test_failed_requests_or_short_output_make_a_run_not_count() -> None:
    result = {**json.loads(RESULT.read_text()), "failed": 2, "completed": 6, "total_output_tokens": 768,
              "errors": ["", "Bad Request", "", "", "", "Bad Request", "", ""]}
    found = problems(summarize(result), 8 * 128)
    assert len(found) == 2
    assert "2 failed" in found[0] and "Bad Request" in found[0]
    assert "768 output tokens where 1024" in found[1]


def test_ratios_pair_each_round_and_read_above_one_where_warmstart_is_ahead() -> None:
    rounds = [{"warmstart": row(150, 400, 50), "vllm": row(100, 800, 40)},
              {"warmstart": row(120, 600, 60), "vllm": row(100, 300, 60)},
              {"warmstart": row(999, 1, 1)}]  # vLLM's side missing: no ratio from this round
    report = report_workload(WORKLOADS["random"], 48, rounds)
    ratios = report["ratios"]
    assert ratios["output tok/s warmstart/vLLM"]["per_round"] == pytest.approx([1.5, 1.2])
    assert ratios["TTFT p50 vLLM/warmstart"]["per_round"] == pytest.approx([2.0, 0.5])
    assert ratios["TPOT p50 vLLM/warmstart"]["per_round"] == pytest.approx([0.8, 1.0])
    assert ratios["output tok/s warmstart/vLLM"]["median"] == pytest.approx(1.35)
    assert report["medians"]["warmstart"]["output_tok_s"] == 150  # of all three rounds
    assert report["medians"]["vllm"]["ttft_p50_ms"] == pytest.approx(550)


def test_table_shows_the_medians_and_each_rounds_ratio() -> None:
    rounds = [{"warmstart": row(150, 400, 50), "vllm": row(100, 800, 40)},
              {"warmstart": row(120, 600, 60), "vllm": row(100, 300, 60)}]
    table = format_table(report_workload(WORKLOADS["prefix"], 48, rounds)).splitlines()
    assert table[0].startswith("prefix: 48 prompts, 1,024-token shared prefix + 128 in / 128 out, Poisson 2 req/s")
    warmstart = next(line for line in table if line.startswith("warmstart")).split()
    assert warmstart[1:4] == ["135.0", "1.05", "500"]
    assert warmstart[7] == "-"  # no prefix cache counts in these rows
    assert any("output tok/s warmstart/vLLM" in line and "1.35x" in line and "1.50, 1.20" in line for line in table)


def test_prefix_cache_counts_are_read_from_either_servers_metrics() -> None:
    warmstart = """# HELP warmstart:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE warmstart:prefix_cache_hits_total counter
warmstart:prefix_cache_queries_total{model_name="smollm2"} 9216.0
warmstart:prefix_cache_hits_total{model_name="smollm2"} 7168.0
warmstart:prefix_cache_hits_created{model_name="smollm2"} 1.7e9
"""
    vllm = """vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 13312.0
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 7168.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="smollm2"} 5.0
"""
    assert prefix_cache_tokens(warmstart) == (9216.0, 7168.0)
    assert prefix_cache_tokens(vllm) == (13312.0, 7168.0)
    assert prefix_cache_tokens("") == (0.0, 0.0)


def test_the_tester_sends_every_server_the_same_seeded_workload(tmp_path: Path) -> None:
    cli, model, result = Path("/venv/bin/vllm"), Path("/models/smollm2"), tmp_path / "r0.json"
    ours = bench_command(cli, WORKLOADS["prefix"], "http://127.0.0.1:1", model, 48, 7, result)
    theirs = bench_command(cli, WORKLOADS["prefix"], "http://127.0.0.1:2", model, 48, 7, result)
    assert [a for a in ours if "127.0.0.1" not in a] == [a for a in theirs if "127.0.0.1" not in a]

    def value(flag: str) -> str:
        return ours[ours.index(flag) + 1]

    assert ours[:3] == [str(cli), "bench", "serve"]
    assert (value("--random-prefix-len"), value("--random-input-len"), value("--random-output-len")) == (
        "1024", "128", "128")
    assert (value("--request-rate"), value("--seed"), value("--num-prompts")) == ("2", "7", "48")
    assert (value("--backend"), value("--endpoint"), value("--tokenizer")) == ("openai", "/v1/completions", str(model))
    assert (value("--result-dir"), value("--result-filename")) == (str(tmp_path), "r0.json")
    assert "--ignore-eos" in ours and value("--temperature") == "0" and value("--metric-percentiles") == "50,99"
