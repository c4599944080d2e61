"""gc removes what killed writers leave behind (temporary files in a local store, downloads, lock files and
build staging directories in the cache) once it is older than the grace period, and never a live writer's."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.cli import WARMSTART
from warmstart.snapshot.cache import BlobCache, BlobLock
from warmstart.snapshot.format import FORMAT, FORMAT_VERSION, Manifest, blob_id
from warmstart.snapshot.gc import gc
from warmstart.snapshot.store import LocalStore

REPO = Path(__file__).resolve().parents[2]
HOURS_AGO = 2 * 3600

PUT_AND_STALL = """
import sys, time
from pathlib import Path
from warmstart.snapshot.format import file_blob_id
from warmstart.snapshot.store import LocalStore

store_dir, blob_path, marker = sys.argv[1:]

def stall(_: int) -> None:  # called once the first piece is in the temporary file
    Path(marker).touch()
    time.sleep(60)

LocalStore(store_dir).put_blob(file_blob_id(blob_path), blob_path, on_bytes=stall)
"""


def age(*paths: Path, seconds: float = HOURS_AGO) -> None:
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def push_small_snapshot(store: LocalStore, tmp_path: Path) -> tuple[str, str]:
    data = b"a referenced blob"
    (tmp_path / "kept").write_bytes(data)
    store.put_blob(blob_id(data), tmp_path / "kept")
    raw = Manifest({"format": FORMAT, "format_version": FORMAT_VERSION, "blobs": {blob_id(data): len(data)}}).encode()
    store.put_manifest(blob_id(raw), raw)
    return blob_id(raw), blob_id(data)


def kill_a_push_mid_write(store: LocalStore, tmp_path: Path) -> Path:
    """A real process writing a blob into the store, killed with SIGKILL while the blob's temporary file is open;
    returns that file."""
    blob = tmp_path / "big"
    blob.write_bytes(random.Random(0).randbytes(2 << 20))
    marker = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", PUT_AND_STALL, str(store.root), str(blob), str(marker)], cwd=REPO)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (left,) = [p for p in (store.root / "blobs").iterdir() if p.name.startswith(".")]
    assert left.name.endswith(".tmp") and left.stat().st_size > 0
    return left


def test_gc_removes_the_temporary_file_of_a_push_killed_mid_write(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    snapshot, referenced = push_small_snapshot(store, tmp_path)
    left = kill_a_push_mid_write(store, tmp_path)

    fresh = gc(store, grace_seconds=3600)  # as young as a live writer's temporary file: kept
    assert (fresh.temporaries_deleted, fresh.temporary_bytes_freed) == (0, 0) and left.exists()

    age(left)
    live = store.root / "blobs" / f".{blob_id(b'being written')}.0123456789ab.tmp"
    live.write_bytes(b"a push in flight")
    size = left.stat().st_size
    dry = gc(store, dry_run=True, grace_seconds=3600)
    assert (dry.temporaries_deleted, dry.temporary_bytes_freed) == (1, size) and left.exists()
    report = gc(store, grace_seconds=3600)
    assert (report.temporaries_deleted, report.temporary_bytes_freed) == (1, size)
    assert not left.exists() and live.exists()
    assert [b for b, _, _ in store.list_blobs()] == [referenced] and store.list_snapshots() == [snapshot]


def test_gc_cleans_the_cache_of_stale_temporaries_and_spares_live_ones(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    push_small_snapshot(store, tmp_path)
    cache = BlobCache(tmp_path / "cache")
    root = cache.root
    (tmp_path / "cached").write_bytes(b"a cached blob")
    cached = cache.add_file(blob_id(b"a cached blob"), tmp_path / "cached")
    ids = [blob_id(bytes([n])) for n in range(3)]

    staging = root / "tmpab12cd_9"  # a killed build's staging directory
    staging.mkdir()
    (staging / "blob").write_bytes(b"x" * 1000)
    download = root / "tmp" / ids[0]  # a killed pull's download, its lock free
    download.write_bytes(b"y" * 300)
    lock_file = root / "locks" / ids[1]  # a killed pull's lock file
    lock_file.touch()
    atomic_blob = root / "blobs" / f".{ids[2]}.0123456789ab.tmp"
    atomic_blob.write_bytes(b"z" * 50)
    atomic_manifest = root / "snapshots" / f".{ids[2]}.msgpack.abcdefabcdef.tmp"
    atomic_manifest.write_bytes(b"m" * 7)
    stale = [staging / "blob", staging, download, lock_file, atomic_blob, atomic_manifest]

    live_staging = root / "tmpzz99yy88"  # a build writing now
    live_staging.mkdir()
    (live_staging / "blob").write_bytes(b"w" * 10)
    slow_download = root / "tmp" / ids[2]  # old, but its pull is still running (it holds the lock)
    slow_download.write_bytes(b"s" * 20)
    someone_elses = root / "notes.txt"
    someone_elses.write_text("not ours")
    age(*stale, cached, slow_download, someone_elses)

    holder = BlobLock(root / "locks" / ids[2])
    assert holder.acquire(blocking=False)
    try:
        age(root / "locks" / ids[2])
        env = {**os.environ, "WARMSTART_STORE": str(store.root), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([*WARMSTART, "gc", "--cache", str(root), "--json"],
                              capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert (result["temporaries_deleted"], result["temporary_bytes_freed"]) == (5, 1000 + 300 + 50 + 7)
        assert (result["blobs_deleted"], result["kept"]) == (0, 1)
        assert not any(p.exists() for p in stale)
        assert all(p.exists() for p in (live_staging / "blob", slow_download, root / "locks" / ids[2], cached,
                                        someone_elses, root / "tmp"))
    finally:
        holder.release()
    assert cache.has(blob_id(b"a cached blob"))
