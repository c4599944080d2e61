"""Fixtures of the command-line tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "WARMSTART_STORE": str(tmp_path / "store"), "WARMSTART_CACHE": str(tmp_path / "cache"),
            "OMP_NUM_THREADS": "1"}
