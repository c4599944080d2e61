"""benchmarks/gpu_check.py runs end to end on the CPU at toy size (--dry-run), so the prepared GPU script is
known to work up to what only a GPU can run: its served section starts real `warmstart serve --device cpu`
processes (the Triton kernels under the interpreter) and benchmarks/hf_handler.py, as the GPU run does with
`--device cuda`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


DryRun = tuple[subprocess.CompletedProcess[str], dict, Path]


def dry_run(out: Path, *args: str, timeout: int = 300) -> tuple[subprocess.CompletedProcess[str], dict]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    report = json.loads((out / "gpu_check-dry.json").read_text()) if (out / "gpu_check-dry.json").is_file() else {}
    return done, report


@pytest.fixture(scope="module")
def full_dry_run(tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    out = tmp_path_factory.mktemp("gpu-check")
    done, report = dry_run(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, report, out


@pytest.mark.slow
def test_gpu_check_dry_run_fills_every_section(full_dry_run: DryRun) -> None:
    _, report, out = full_dry_run
    assert report["failures"] == []
    sections = report["sections"]
    assert sections["engine_vs_transformers"]["result"]["llama3"] == {
        "matches": True, "ops": "triton", "graph_batch_sizes": []  # graphs are CUDA-only
    }
    drift = sections["bf16_drift"]["result"]["tiny-llama"]
    assert drift["matches"] and drift["ours_fp32_max_diff"] < 1e-3 and len(drift["rows"]) == 6
    kernels = sections["first_call"]["result"]["carried_cache"]["kernels"]
    assert {"decode_attention_split", "prefill_attention", "int8_matmul"} <= set(kernels)
    assert all(r["ratio"] > 0 for name, r in sections["throughput"]["result"].items() if name.startswith("tiny-"))
    assert "skipped" in sections["host_to_device"]["result"] and "skipped" in sections["kernels"]["result"]
    assert (out / "gpu_check-dry.md").read_text().startswith("# gpu_check")


@pytest.mark.slow
def test_gpu_check_dry_run_serves_from_a_real_process(full_dry_run: DryRun) -> None:
    done, report, _ = full_dry_run
    served = report["sections"]["served"]["result"]["tiny-llama"]
    empty, warm = served["cold_start"]["empty_caches"], served["cold_start"]["warm_caches"]
    for run in (empty, warm):
        status = run["status"]
        assert status["device"] == "cpu" and status["ops"] == "triton"  # what --device cpu and the dry run ask
        assert {"listening", "blobs", "mapped", "ready", "first_token"} <= set(status["phases"])
        assert 0 < run["ready_s"] < run["first_token_s"]
    assert empty["status"]["pull"]["blobs_downloaded"] == empty["status"]["pull"]["blobs_total"] > 0
    assert warm["status"]["pull"]["blobs_downloaded"] == 0  # the second start finds the first one's blobs
    greedy = served["greedy"]
    assert greedy["matches"] and greedy["identical"] == greedy["prompts"] == 2  # float32 on the CPU: exact
    load = served["load"]
    for system in ("warmstart", "transformers"):
        assert load[system]["errors"] == 0 and load[system]["tok_s"] > 0 and load[system]["ttft_p50_s"] > 0
    assert load["tok_s_ratio"] > 0 and load["ttft_p50_ratio"] > 0
    assert "served tiny-llama (float32)" in done.stdout and "ratio" in done.stdout


def test_gpu_check_skips_what_its_budget_leaves_no_time_for(tmp_path: Path) -> None:
    done, report = dry_run(tmp_path, "--budget-s", "0", timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(report["sections"]) == ["host_to_device", "served", "engine_vs_transformers", "bf16_drift",
                                        "bench_models", "first_call", "throughput", "kernels"]
    for name, section in report["sections"].items():
        assert "budget left" in section["skipped"], name
    assert "served: skipped, 0 s of the 0 s budget left" in done.stdout
