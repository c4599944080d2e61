"""`warmstart build ORG/NAME` as a vLLM user runs it: the model comes through huggingface_hub's cache (the hub
itself is out of reach here: HF_ENDPOINT points at a closed port)."""

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
    assert built["hub"] == {"hub_id": "org/tiny", "revision": COMMIT}
    info = last_json(warmstart("inspect", "tiny", "--json", env=env_with_hub))
    assert info["hub"] == built["hub"] and info["architecture"] == "Qwen3ForCausalLM"
    local = last_json(warmstart("build", str(model), "--dtype", "float32", "--json", env=env_with_hub))
    assert local["hub"] is None and local["id"] != built["id"]  # the same weights; the provenance differs
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

