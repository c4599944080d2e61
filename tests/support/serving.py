"""What the serving tests share: a tiny model's snapshot with a system prefix and a text prefix, in a local
store, and a ServeState loaded from it in-process."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.cli import WARMSTART
from warmstart.handlers.server.state import Limits, ServeState, load_snapshot
from warmstart.handlers.server.timeline import cold_start_timeline
from warmstart.snapshot.build import BuildOptions, PrefixSpec, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import push_snapshot

REF = "tiny"
REPO = Path(__file__).resolve().parents[2]
KEY = "e2e-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
START_TIMEOUT = 90.0
SYSTEM_TEXT = "You are a terse assistant. Answer in one short sentence, and never apologise for anything. " * 3
DOC_TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 3


@dataclass
class TinySnapshot:
    id: str
    store: Path
    cache: Path
    cached_tokens: dict[str, int]  # prefix name -> tokens a request starting with it finds in the cache


def build_tiny_snapshot(model_dir: Path, root: Path, system_text: str = SYSTEM_TEXT,
                        doc_text: str = DOC_TEXT) -> TinySnapshot:
    (root / "system.txt").write_text(system_text)
    (root / "doc.txt").write_text(doc_text)
    prefixes = [PrefixSpec("assistant", root / "system.txt", "system"), PrefixSpec("doc", root / "doc.txt", "text")]
    cache = root / "cache"
    built = build_snapshot(model_dir, BuildOptions(dtype="float32", prefixes=prefixes), BlobCache(cache))
    store = open_store(str(root / "store"))
    push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    store.set_ref(REF, built.id)
    block = built.manifest.data["engine"]["block_size"]
    cached = {p["name"]: len(p["block_hashes"]) * block for p in built.manifest.data["prefixes"]}
    return TinySnapshot(built.id, root / "store", cache, cached)


def ready_state(snap: TinySnapshot, limits: Limits | None = None, **engine_options: Any) -> ServeState:
    state = ServeState(REF, REF, cold_start_timeline(), limits or Limits())
    options = {"num_kv_blocks": 64, "max_model_len": 256, **engine_options}
    load_snapshot(state, str(snap.store), snap.cache, options)
    assert state.status == "ready", state.error
    return state


def error_of(response: Any) -> dict[str, Any]:
    """The OpenAI error object of a 4xx/5xx response, checked for shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error  # type: ignore[no-any-return]


class ServerProcess:
    """A `warmstart serve` child; its stdout's JSON lines are collected by a thread."""

    def __init__(self, snap: TinySnapshot, *args: str, env: dict[str, str] | None = None, ref: str = REF) -> None:
        cmd = [*WARMSTART, "serve", ref, "--store", str(snap.store), "--cache",
               str(snap.cache), "--port", "0", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WARMSTART_API_KEY": KEY, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=REPO)
        self.events: list[dict[str, Any]] = []
        self._new: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self.wait_for("listening")["url"]
        self.port = int(self.url.rsplit(":", 1)[1])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            self.events.append(event)
            self._new.put(event)
        self._new.put(None)

    def wait_for(self, phase: str) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            event = self._new.get(timeout=max(0.1, deadline - time.monotonic()))
            if event is None:
                raise AssertionError(f"server exited ({self.proc.wait()}): {self.proc.stderr.read()}")  # type: ignore[union-attr]
            if event.get("phase") == phase:
                return event

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@contextmanager
def ready_side_by_side(started: dict[str, ServerProcess]) -> Iterator[dict[str, ServerProcess]]:
    """Servers started at once (each imports torch meanwhile), once all are ready; each stopped at the end."""
    try:
        for server in started.values():
            server.wait_for("ready")
        yield started
    finally:
        for server in started.values():
            server.stop()
