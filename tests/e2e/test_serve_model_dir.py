"""`warmstart serve DIR` with an HF model directory or a hub id: built into the store, then served, in one command,
as a `vllm serve DIR` user expects; a name that is neither says what to run instead."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

from tests.support.cli import WARMSTART
from tests.support.hf_cache import COMMIT, cache_hub_model, hub_env
from tests.support.serving import AUTH, KEY, REPO, ServerProcess, TinySnapshot
from warmstart.runtime import LLM, SamplingParams
from warmstart.snapshot.stores import open_store


def test_serve_builds_a_model_directory_then_serves_it(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    place = TinySnapshot("", tmp_path / "store", tmp_path / "cache", {})
    server = ServerProcess(place, "--num-kv-blocks", "64", "--max-model-len", "256", ref=str(model_dir))
    try:
        ready = server.wait_for("ready")
        built = next(e for e in server.events if e.get("phase") == "build")
        assert ready["snapshot_id"] == built["snapshot_id"] and built["model_dir"] == str(model_dir)
        assert any(e.get("event") == "build" and "converting weights" in e["message"] for e in server.events)
        assert built["snapshot_id"] in open_store(str(tmp_path / "store")).list_snapshots()
        body = {"model": str(model_dir), "prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        request = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(body).encode(),
                                         {**AUTH, "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            served = json.loads(reply.read())["choices"][0]
    finally:
        assert server.stop() == 0
    reference = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=64).generate(
        [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert served["text"] == reference.text


def test_a_hub_id_out_of_reach_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    env = {**hub_env(dict(os.environ), tmp_path / "hf"), "WARMSTART_API_KEY": KEY,
           "WARMSTART_STORE": str(tmp_path / "store"), "WARMSTART_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([*WARMSTART, "serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "0"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    error = json.loads(proc.stdout.strip().splitlines()[-1])
    assert error["event"] == "error"
    assert error["message"].startswith("HuggingFaceTB/SmolLM2-135M-Instruct is not in the Hugging Face cache")
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct`" in error["message"]


def test_a_name_that_is_no_snapshot_says_how_to_make_one(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    env = {**os.environ, "WARMSTART_API_KEY": KEY, "WARMSTART_STORE": str(tmp_path / "store"),
           "WARMSTART_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([*WARMSTART, "serve", "smollm2-latest", "--port", "0"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "build one with `warmstart build MODEL_DIR --tag NAME`" in proc.stderr


def test_serve_a_hub_id_builds_it_then_serves_it(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cache_hub_model(tmp_path / "hf", "org/tiny", tiny_model_dir("llama"))
    env = hub_env({}, tmp_path / "hf")
    place = TinySnapshot("", tmp_path / "store", tmp_path / "cache", {})
    server = ServerProcess(place, "--num-kv-blocks", "64", "--max-model-len", "256", ref="org/tiny", env=env)
    try:
        ready = server.wait_for("ready")
        built = next(e for e in server.events if e.get("phase") == "build")
        assert built["source"] == {"hub_id": "org/tiny", "revision": COMMIT}
        assert ready["snapshot_id"] == built["snapshot_id"]
        body = {"model": "org/tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(body).encode(),
                                         {**AUTH, "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0
