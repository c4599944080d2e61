"""A Hugging Face hub cache on disk, as `hf download` leaves it: the hub is out of reach from the tests, its cache
is not (huggingface_hub resolves ORG/NAME from it, HF_HUB_OFFLINE or not)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_hub_model(hf_home: Path, repo_id: str, model_dir: Path, commit: str = COMMIT, branch: str = "main") -> Path:
    """``model_dir``'s files as ``repo_id`` at ``commit`` under HF_HOME=``hf_home``, ``branch`` pointing at it;
    returns the snapshot folder."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once the socket is closed


def hub_env(base: dict[str, str], hf_home: Path) -> dict[str, str]:
    """``base`` with huggingface_hub's cache at ``hf_home`` and its endpoint at a closed port on 127.0.0.1."""
    return {**{k: v for k, v in base.items() if not k.startswith("HF_")}, "HF_HOME": str(hf_home),
            "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
