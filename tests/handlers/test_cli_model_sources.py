"""What `warmstart build MODEL` takes besides a model directory, as a vLLM user passes them: a hub id, through
huggingface_hub's cache (the hub itself is out of reach here: HF_ENDPOINT points at a closed port), and a GGUF
file, converted once into the models cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import last_json, warmstart
from tests.support.hf_cache import COMMIT, cache_hub_model, hub_env


@pytest.fixture
def env_with_hub(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return hub_env(env, tmp_path / "hf")


def test_build_of_a_hub_id_records_its_commit(tiny_model_dir, tmp_path: Path, env_with_hub: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model_dir("qwen3")
    cache_hub_model(tmp_path / "hf", "org/tiny", model)
    built = last_json(warmstart("build", "org/tiny", "--dtype", "float32", "--tag", "tiny", "--json", env=env_with_hub))
    assert built["source"] == {"hub_id": "org/tiny", "revision": COMMIT}
    info = last_json(warmstart("inspect", "tiny", "--json", env=env_with_hub))
    assert info["source"] == built["source"] and info["architecture"] == "Qwen3ForCausalLM"
    local = last_json(warmstart("build", str(model), "--dtype", "float32", "--json", env=env_with_hub))
    assert local["source"] is None and local["id"] != built["id"]  # the same weights; the provenance differs
    assert local["blobs_uploaded"] == 0  # every blob was already there from the hub build
    pinned = last_json(warmstart("build", "org/tiny", "--revision", COMMIT, "--dtype", "float32", "--json",
                                 env=env_with_hub))  # fmt: skip
    assert pinned["id"] == built["id"]


def test_a_hub_id_out_of_reach_is_one_line(tmp_path: Path, env_with_hub: dict[str, str]) -> None:
    done = warmstart("build", "org/absent", env=env_with_hub)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line
    assert done.stderr.startswith("warmstart: error: org/absent is not in the Hugging Face cache")
    revision = warmstart("build", str(tmp_path), "--revision", "main", env=env_with_hub)
    assert revision.returncode == 1 and "--revision is for a hub id" in revision.stderr



def test_build_of_a_gguf_file_converts_it_once(tmp_path: Path, env: dict[str, str]) -> None:
    pytest.importorskip("gguf", reason="the `gguf` package (test extra) writes the tiny checkpoint")
    from tests.support.gguf_model import write_tiny_llama_gguf
    from warmstart.snapshot.format import file_blob_id

    gguf_file = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(gguf_file)
    env = {**env, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    first = warmstart("build", str(gguf_file), "--dtype", "float32", env=env)
    assert first.returncode == 0 and "converting tiny-llama.gguf" in first.stderr, first.stderr
    converted = next((tmp_path / "xdg" / "warmstart" / "models" / "gguf").iterdir())
    built = last_json(warmstart("build", str(gguf_file), "--dtype", "float32", "--json", env=env))
    assert built["source"] == {"gguf": "tiny-llama.gguf", "gguf_xxh3": file_blob_id(gguf_file)}
    assert built["blobs_uploaded"] == 0  # the same snapshot: converted once, then read from the models cache
    again = warmstart("build", str(gguf_file), "--dtype", "float32", env=env)
    assert again.returncode == 0 and "converting tiny-llama.gguf" not in again.stderr
    from_dir = last_json(warmstart("build", str(converted), "--dtype", "float32", "--json", env=env))
    assert from_dir["blobs_uploaded"] == 0  # the converted directory is what was built
    other = tmp_path / "notes.txt"
    other.write_text("not a model")
    refused = warmstart("build", str(other), env=env)
    assert refused.returncode == 1 and "a GGUF file or a hub id" in refused.stderr
