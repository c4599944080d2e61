"""The `warmstart` command as a user runs it: a real subprocess, a local store, --json on the last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WARMSTART = (sys.executable, "-m", "warmstart.handlers.cli")  # the command, run by this interpreter


def warmstart(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WARMSTART, *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=Path(__file__).resolve().parents[2])


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
