"""`warmstart serve --tensor-parallel 2` as real processes (rank 0 serves HTTP and starts rank 1): output equal to
the single-rank engine, each rank's cold start in /status and /metrics, and a killed rank taking the server to a
clean failure (health 503, non-zero exit) instead of a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.support.cli import WARMSTART
from tests.support.serving import AUTH, REF, REPO, ServerProcess, TinySnapshot
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.sampling_params import SamplingParams
from warmstart.snapshot.build import BuildOptions, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import push_snapshot

PROMPT = [5, 17, 99, 243, 12, 800, 41, 7, 300]


def tp_snapshot(model_dir: Path, root: Path):  # type: ignore[no-untyped-def]
    built = build_snapshot(model_dir, BuildOptions(dtype="float32", tensor_parallel=2), BlobCache(root / "build"))
    store = open_store(str(root / "store"))
    push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    store.set_ref(REF, built.id)
    return built, TinySnapshot(built.id, root / "store", root / "cache", {})


def test_two_rank_server_serves_then_fails_cleanly_when_a_rank_dies(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir("llama")
    built, snap = tp_snapshot(model_dir, tmp_path)
    server = ServerProcess(snap, "--tensor-parallel", "2", "--num-kv-blocks", "64", "--max-model-len", "256")
    try:
        server.wait_for("ready")
        mapped = next(e for e in server.events if e.get("phase") == "mapped")  # every rank's own cold start
        assert [sorted(r) for r in mapped["ranks"]] == [["blobs_total", "bytes_downloaded", "map_seconds",
                                                         "pull_seconds", "rank"]] * 2
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"model": REF, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        engine = LLMEngine.from_hf(model_dir, EngineOptions(dtype="float32", num_kv_blocks=64))
        engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        text = ""
        while engine.has_unfinished():
            text = engine.step()[-1].text
        assert r.json()["choices"][0]["text"] == text

        ranks = httpx.get(server.url + "/status", headers=AUTH).json()["tensor_parallel"]["ranks"]
        # One cache on one machine: a blob both ranks need (embeddings, tokenizer) is pulled by one of them.
        assert [x["rank"] for x in ranks] == [0, 1] and all(x["bytes_downloaded"] > 0 for x in ranks)
        assert sum(x["bytes_downloaded"] for x in ranks) == sum(built.manifest.blob_sizes().values())
        metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
        assert 'warmstart:tensor_parallel_rank_pull_seconds{rank="1"}' in metrics
        steps = next(line for line in metrics.splitlines() if line.startswith("warmstart:tensor_parallel_steps_total"))
        assert float(steps.split()[1]) >= 8

        follower = next(e for e in server.events if e.get("event") == "tensor_parallel")["ranks"][0]["pid"]
        os.kill(follower, signal.SIGKILL)
        code = server.proc.wait(timeout=30)  # no hang: the watcher notices and the server stops
        assert code != 0
        error = next(e for e in server.events if e.get("event") == "error")
        assert "rank 1 exited" in error["message"]
    finally:
        server.stop()



def test_sigterm_stops_every_rank_cleanly(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, snap = tp_snapshot(tiny_model_dir("qwen3"), tmp_path)
    server = ServerProcess(snap, "--tensor-parallel", "2", "--num-kv-blocks", "32", "--max-model-len", "128")
    try:
        server.wait_for("ready")
        assert server.stop() == 0
        deadline = time.monotonic() + 10  # the reader thread may still be on the last lines
        while not any(e.get("event") == "stopped" for e in server.events) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert next(e for e in server.events if e.get("event") == "stopped")["follower_exit_codes"] == [0]
    finally:
        server.stop()


def test_build_and_inspect_on_the_command_line(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "WARMSTART_STORE": str(tmp_path / "store"), "WARMSTART_CACHE": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}

    def warmstart(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*WARMSTART, *args], capture_output=True, text=True, env=env,
                              timeout=300, cwd=REPO)

    model = tiny_model_dir("llama")  # 4 heads, 2 KV heads of 48, hidden 96
    built = warmstart("build", str(model), "--dtype", "float32", "--tensor-parallel", "2", "--tag", "tp2", "--json")
    assert built.returncode == 0, built.stderr
    info = json.loads(warmstart("inspect", "tp2", "--json").stdout.splitlines()[-1])
    assert info["tensor_parallel"] == 2 and info["tensors"]["layers.0.qkv"]["shape"] == [(4 + 2 * 2) * 48 // 2, 96]
    assert len(info["bytes_per_rank"]) == 2 and all(b < info["bytes"] for b in info["bytes_per_rank"])
    refused = warmstart("build", str(model), "--tensor-parallel", "3")
    assert refused.returncode == 1 and "num_key_value_heads=2" in refused.stderr and "Traceback" not in refused.stderr
