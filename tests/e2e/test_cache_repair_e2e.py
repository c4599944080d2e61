"""A damaged local cache as a user meets it: `warmstart pull`, `warmstart verify` and `warmstart serve` as real
processes over a tiny model's snapshot whose cached blobs were overwritten with NaNs, truncated or emptied."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cli import WARMSTART
from tests.support.serving import AUTH, REF, REPO, ServerProcess, TinySnapshot, build_tiny_snapshot
from warmstart.runtime import SamplingParams
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.format import Manifest, file_blob_id
from warmstart.snapshot.loader import SnapshotError, engine_from_manifest, load

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("repair"))


@pytest.fixture(scope="module")
def reference(snap: TinySnapshot, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The greedy completion of PROMPT from an undamaged cache."""
    llm = load(REF, store=str(snap.store), cache=tmp_path_factory.mktemp("clean-cache"), num_kv_blocks=64)
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0].text


def weight_blobs(snap: TinySnapshot) -> list[str]:
    """The snapshot's weight blobs: two decoder layers, then embeddings and head."""
    manifest = Manifest.decode(BlobCache(snap.cache).get_manifest(snap.id) or b"")
    tensors = manifest.data["tensors"]
    return [tensors["layers.0.qkv"]["blob"], tensors["layers.1.qkv"]["blob"], tensors["embed"]["blob"]]


def damage(path: Path, how: str) -> None:
    """In place, as a tool writing into the cache would: NaNs over every byte (same size), half, or nothing."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if how == "nan":
            f.write(b"\xff" * size)  # all-ones: NaN in float32 and bfloat16 alike
        f.truncate({"nan": size, "truncated": size // 2, "empty": 0}[how])


def warmstart(snap: TinySnapshot, *args: str) -> dict[str, Any]:
    proc = subprocess.run([*WARMSTART, *args, "--store", str(snap.store), "--cache",
                           str(snap.cache), "--json"], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def completion(server: ServerProcess) -> str:
    body = {"model": REF, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_pull_and_verify_repair_the_cache_and_serve_answers_right(snap: TinySnapshot, reference: str) -> None:
    nan, truncated, empty = weight_blobs(snap)
    cache = BlobCache(snap.cache)
    for blob, how in ((nan, "nan"), (truncated, "truncated"), (empty, "empty")):
        damage(cache.path(blob), how)
    pulled = warmstart(snap, "pull", REF)
    assert (pulled["blobs_replaced"], pulled["blobs_downloaded"]) == (3, 3)

    damage(cache.path(nan), "nan")  # same size: found by its hash only
    verified = warmstart(snap, "verify")
    assert [(b["blob"], b["action"].split(" from ")[0]) for b in verified["bad"]] == [(nan, "downloaded again")]
    assert "hash to" in verified["bad"][0]["problem"] and verified["blobs_checked"] >= len(weight_blobs(snap))

    damage(cache.path(truncated), "truncated")  # sizes: a cold start checks them and downloads again
    damage(cache.path(empty), "empty")
    server = ServerProcess(snap, "--num-kv-blocks", "64", "--max-model-len", "256")
    try:
        assert server.wait_for("blobs")["blobs_downloaded"] == 2
        server.wait_for("ready")
        assert completion(server) == reference
    finally:
        assert server.stop() == 0

    assert warmstart(snap, "verify", REF)["bad"] == []
    assert all(file_blob_id(cache.path(b)) == b for b in weight_blobs(snap))


def test_mapping_a_blob_of_the_wrong_size_is_one_sentence(snap: TinySnapshot, tmp_path: Path) -> None:
    from warmstart.snapshot.store import LocalStore
    from warmstart.snapshot.transfer import pull_snapshot

    cache = BlobCache(tmp_path / "cache")
    raw, _ = pull_snapshot(LocalStore(snap.store), cache, snap.id)
    blob = weight_blobs(snap)[1]
    damage(cache.path(blob), "truncated")
    with pytest.raises(SnapshotError, match=rf"blob {blob} .* bytes, the manifest says .*warmstart verify"):
        engine_from_manifest(Manifest.decode(raw), cache, {"num_kv_blocks": 16})
    cache.path(blob).unlink()
    with pytest.raises(SnapshotError, match=rf"blob {blob} .* missing from the cache"):
        engine_from_manifest(Manifest.decode(raw), cache, {"num_kv_blocks": 16})
