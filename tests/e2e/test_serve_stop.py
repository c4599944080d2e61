"""A server stopped (SIGTERM) right after it is ready, while the bf16 weights' background prepacking still runs,
exits 0 with nothing on stderr: the platform's stop is a clean one, not a crash (it was SIGABRT, 134)."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.support.serving import REF, ServerProcess, TinySnapshot
from warmstart import runtime
from warmstart.runtime.random_model import make_random_model
from warmstart.snapshot.build import BuildOptions, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import push_snapshot


def test_a_stop_during_prepacking_exits_0(tmp_path: Path) -> None:
    # SmolLM2-135M's shape: packing its weights takes long enough for the stop to land while it runs
    config = Path(runtime.__file__).parent / "configs" / "smollm2-135m.json"
    model_dir = make_random_model(tmp_path / "model", config, seed=0, dtype="bfloat16")
    built = build_snapshot(model_dir, BuildOptions(dtype="bfloat16"), BlobCache(tmp_path / "cache"))
    store = open_store(str(tmp_path / "store"))
    push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    store.set_ref(REF, built.id)
    snap = TinySnapshot(built.id, tmp_path / "store", tmp_path / "cache", {})
    for _ in range(3):
        server = ServerProcess(snap, "--num-kv-blocks", "16", "--max-model-len", "128")
        server.wait_for("ready")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert server.proc.stderr is not None and server.proc.stderr.read() == ""
