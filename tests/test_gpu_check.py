"""benchmarks/gpu_check.py runs end to end on the CPU at toy size (--dry-run), so the prepared GPU script is
known to work up to what only a GPU can run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_dry_run_fills_every_section(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check-dry.json").read_text())
    sections = report["sections"]
    assert sections["engine_vs_transformers"]["result"]["llama3"] == {
        "matches": True, "ops": "triton", "graph_batch_sizes": []  # graphs are CUDA-only
    }
    kernels = sections["first_call"]["result"]["carried_cache"]["kernels"]
    assert {"decode_attention_split", "prefill_attention", "int8_matmul"} <= set(kernels)
    assert all(r["ratio"] > 0 for name, r in sections["throughput"]["result"].items() if name.startswith("tiny-"))
    assert "skipped" in sections["host_to_device"]["result"] and "skipped" in sections["cold_start"]["result"]
    assert (tmp_path / "gpu_check-dry.md").read_text().startswith("# gpu_check")
