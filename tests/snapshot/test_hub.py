"""snapshot/hub.py: hub ids told from paths, and resolved through huggingface_hub's cache in a child process each
(huggingface_hub reads HF_HOME, HF_HUB_OFFLINE and HF_ENDPOINT when it is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.hf_cache import COMMIT, cache_hub_model, hub_env
from warmstart.snapshot.hub import is_hub_id

REPO = Path(__file__).resolve().parents[2]
RESOLVE = """
import json, sys
from warmstart.snapshot import hub
try:
    m = hub.resolve(sys.argv[1], sys.argv[2] or None)
    print(json.dumps({"path": str(m.path), "provenance": m.provenance()}))
except hub.HubError as e:
    print(json.dumps({"error": str(e)}))
"""


def resolve(hf_home: Path, repo_id: str, revision: str = "", **env: str) -> dict:  # type: ignore[type-arg]
    environment = {**hub_env(dict(os.environ), hf_home), **env}
    done = subprocess.run([sys.executable, "-c", RESOLVE, repo_id, revision], capture_output=True, text=True,
                          cwd=REPO, env=environment, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("ref", "is_id"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("allenai/OLMo-2-0425-1B", True), ("org/name.v2_x", True),
    ("name-only", False), ("a/b/c", False), ("/abs/path", False), ("./org/name", False), ("org/", False),
    ("org--x/name", False), ("org/na..me", False), ("-org/name", False),
])  # fmt: skip
def test_hub_ids_are_told_from_paths_and_refs(ref: str, is_id: bool) -> None:
    assert is_hub_id(ref) is is_id


def test_a_path_that_exists_is_no_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name") and is_hub_id("org/other")


def test_a_cached_model_resolves_with_the_hub_out_of_reach(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    snapshot = cache_hub_model(tmp_path / "hf", "org/tiny", tiny_model_dir("llama"))
    for env in ({}, {"HF_HUB_OFFLINE": "1"}):
        got = resolve(tmp_path / "hf", "org/tiny", **env)
        assert got == {"path": str(snapshot), "provenance": {"hub_id": "org/tiny", "revision": COMMIT}}


def test_a_pinned_commit_is_read_from_the_cache_without_asking_the_hub(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """huggingface_hub would list the commit's files on the hub first, retrying a refused connection for ~20 s."""
    newer = "f" * 40
    cache_hub_model(tmp_path / "hf", "org/tiny", tiny_model_dir("llama"))
    cache_hub_model(tmp_path / "hf", "org/tiny", tiny_model_dir("qwen2"), commit=newer)  # main moves on
    start = time.monotonic()
    got = resolve(tmp_path / "hf", "org/tiny", COMMIT)
    assert got["provenance"] == {"hub_id": "org/tiny", "revision": COMMIT} and time.monotonic() - start < 15
    assert resolve(tmp_path / "hf", "org/tiny")["provenance"]["revision"] == newer


@pytest.mark.parametrize("offline", [False, True])
def test_a_model_neither_cached_nor_reachable_is_one_sentence(tmp_path: Path, offline: bool) -> None:
    got = resolve(tmp_path / "hf", "org/absent", **({"HF_HUB_OFFLINE": "1"} if offline else {}))
    message = got["error"]
    assert message.startswith("org/absent is not in the Hugging Face cache (") and str(tmp_path / "hf") in message
    assert ("HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached") in message
    assert "`hf download org/absent`" in message and "\n" not in message
