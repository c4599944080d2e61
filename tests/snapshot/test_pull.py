"""Push, pull, refs and gc between a store and the local cache: parallel ranged pulls, verification, dedup,
crashes, several processes at once, and an end-to-end run against a moto server on loopback."""

from __future__ import annotations

import errno
import http.server
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

import warmstart.snapshot.transfer as transfer_module
from tests.support.aws import isolate_aws
from tests.support.blobs import SIZES, Built
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.errors import CorruptBlob, NotFound, StoreError, StoreUnreachable, TransferInterrupted
from warmstart.snapshot.format import FORMAT, FORMAT_VERSION, Manifest, blob_id, file_blob_id
from warmstart.snapshot.gc import gc
from warmstart.snapshot.progress import Progress
from warmstart.snapshot.refs import resolve_ref
from warmstart.snapshot.s3 import S3Store
from warmstart.snapshot.store import LocalStore
from warmstart.snapshot.transfer import pull_blobs, pull_snapshot, push_blobs, push_snapshot

REPO = Path(__file__).resolve().parents[2]
PART = 64 << 10


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setattr(transfer_module, "BACKOFF_SECONDS", 0.001)


class CountingStore(LocalStore):
    """Records every ranged read: (blob, start, end)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def stream_range(self, blob: str, start: int, end: int) -> Iterator[bytes]:
        with self._lock:
            self.reads.append((blob, start, end))
        return super().stream_range(blob, start, end)


def assert_cache_holds(cache: BlobCache, built: Built) -> None:
    for bid in built.sizes:
        assert file_blob_id(cache.path(bid)) == bid
    assert_nothing_in_flight(cache)


def assert_nothing_in_flight(cache: BlobCache) -> None:
    assert list((cache.root / "tmp").iterdir()) == []
    assert list((cache.root / "locks").iterdir()) == []


def covers_once(reads: list[tuple[str, int, int]], sizes: dict[str, int]) -> bool:
    """Every byte of every blob was read exactly once."""
    for bid, size in sizes.items():
        spans = sorted((s, e) for b, s, e in reads if b == bid)
        pos = 0
        for start, end in spans:
            if start != pos:
                return False
            pos = end
        if pos != size:
            return False
    return True


# Pull -----------------------------------------------------------------------------------------------------


def test_parallel_ranged_pull_reads_each_byte_once_and_verifies(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    raw, stats = pull_snapshot(store, cache, built.id, concurrency=4, part_size=PART)
    assert raw == built.manifest and cache.get_manifest(built.id) == raw
    assert_cache_holds(cache, built)
    assert (stats.blobs_total, stats.blobs_downloaded, stats.bytes_downloaded) == (5, 5, sum(SIZES))
    assert covers_once(store.reads, built.sizes)
    assert max(Counter(b for b, _, _ in store.reads).values()) > 10  # several parts per blob
    store.reads.clear()
    _, again = pull_snapshot(store, cache, built.id, concurrency=4, part_size=PART)
    assert (again.blobs_downloaded, again.bytes_downloaded, store.reads) == (0, 0, [])


@mock_aws
def test_pull_from_s3_in_ranged_parts(tmp_path: Path) -> None:
    boto3.client("s3").create_bucket(Bucket="pull")
    store = S3Store("s3://pull/x")
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    _, stats = pull_snapshot(store, cache, built.id, concurrency=3, part_size=PART)
    assert stats.bytes_downloaded == sum(SIZES)
    assert_cache_holds(cache, built)


def corrupt(store: LocalStore, bid: str, data: bytes) -> None:
    (store.root / "blobs" / bid).write_bytes(data)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing"])
def test_a_damaged_blob_is_refused_and_leaves_nothing(damage: str, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    victim = max(built.sizes, key=built.sizes.__getitem__)
    good = built.paths[victim].read_bytes()
    if damage == "flipped":
        corrupt(store, victim, good[:1000] + bytes([good[1000] ^ 1]) + good[1001:])
        expected, message = CorruptBlob, f"blob {victim} of snapshot {built.id} .* does not match its name"
    elif damage == "truncated":
        corrupt(store, victim, good[:-1000])
        expected, message = CorruptBlob, f"blob {victim} of snapshot {built.id} .* is truncated"
    else:
        store.delete_blob(victim)
        expected, message = NotFound, f"blob {victim} not found"
    cache = BlobCache(tmp_path / "cache")
    with pytest.raises(expected, match=message):
        pull_snapshot(store, cache, built.id, concurrency=4, part_size=PART)
    assert not cache.has(victim)
    assert cache.get_manifest(built.id) is None
    assert_nothing_in_flight(cache)


class DroppingStore(CountingStore):
    """The connection drops halfway through the first attempt at every part (or at every attempt)."""

    def __init__(self, root: Path, always: bool = False) -> None:
        super().__init__(root)
        self.always = always
        self.tried: set[tuple[str, int]] = set()

    def stream_range(self, blob: str, start: int, end: int) -> Iterator[bytes]:
        first = (blob, end) not in self.tried  # a resumed part keeps its end
        self.tried.add((blob, end))
        inner = super().stream_range(blob, start, end)
        if not (first or self.always) or end - start < 2:
            return inner
        return self._drop(b"".join(inner)[: (end - start) // 2])

    @staticmethod
    def _drop(half: bytes) -> Iterator[bytes]:
        yield half
        raise TransferInterrupted("the connection dropped")


def test_dropped_connections_resume_where_they_stopped(tmp_path: Path) -> None:
    store = DroppingStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    _, stats = pull_snapshot(store, cache, built.id, concurrency=4, part_size=PART)
    assert stats.bytes_downloaded == sum(SIZES)
    assert_cache_holds(cache, built)
    assert len(store.reads) > len(store.tried)  # retried, from the middle of parts


def test_a_connection_that_keeps_dropping_gives_up_cleanly(tmp_path: Path) -> None:
    store = DroppingStore(tmp_path / "store", always=True)
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    with pytest.raises(StoreUnreachable, match="dropped"):
        pull_snapshot(store, cache, built.id, concurrency=4, part_size=PART)
    assert_nothing_in_flight(cache)
    assert cache.get_manifest(built.id) is None


class DownStore(CountingStore):
    def stream_range(self, blob: str, start: int, end: int) -> Iterator[bytes]:
        super().stream_range(blob, start, end)
        raise StoreUnreachable("cannot reach the endpoint")


def test_a_failed_request_is_not_retried_again_on_top_of_botocore(tmp_path: Path) -> None:
    store = DownStore(tmp_path / "store")
    built = Built(tmp_path / "build", sizes=(1000,))
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    with pytest.raises(StoreUnreachable, match="cannot reach"):
        pull_blobs(store, cache, built.sizes)
    assert len(store.reads) == 1
    assert_nothing_in_flight(cache)


class CuttingS3(http.server.BaseHTTPRequestHandler):
    """Just enough of S3 for ranged GETs; the first response for each part is cut off halfway."""

    protocol_version = "HTTP/1.1"
    objects: dict[str, bytes] = {}
    served: Counter[str] = Counter()

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        data = self.objects[self.path.split("?")[0]]
        first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        body = data[first:last + 1]
        part = f"{self.path} {last}"  # a resumed range keeps its end
        self.served[part] += 1
        cut = self.served[part] == 1
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if cut else body)
        self.close_connection = cut

    def log_message(self, *args: object) -> None:
        pass


def test_a_cut_s3_body_is_detected_and_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = Built(tmp_path / "build", sizes=(200_000, 150_000))
    CuttingS3.objects = {f"/cut/blobs/{bid}": path.read_bytes() for bid, path in built.paths.items()}
    CuttingS3.served = Counter()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CuttingS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
        cache = BlobCache(tmp_path / "cache")
        stats = pull_blobs(S3Store("s3://cut"), cache, built.sizes, concurrency=2, part_size=PART)
    finally:
        server.shutdown()
        server.server_close()
    assert stats.bytes_downloaded == sum(built.sizes.values())
    assert_cache_holds(cache, built)
    assert sum(CuttingS3.served.values()) > len(CuttingS3.served)  # the cut ranges were asked for again


def test_a_full_disk_is_one_sentence_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    cache = BlobCache(tmp_path / "cache")
    with pytest.raises(StoreError, match="the disk is full while writing blob .*free some space"):
        pull_snapshot(store, cache, built.id)
    assert_nothing_in_flight(cache)


def test_threads_pulling_at_once_download_each_blob_once(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            pull_blobs(store, BlobCache(cache.root), built.sizes, concurrency=2, part_size=PART)
        except BaseException as e:  # noqa: B036 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=pull) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert covers_once(store.reads, built.sizes)
    assert_cache_holds(cache, built)


PULL_WORKER = """
import os, sys, time
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.store import LocalStore
from warmstart.snapshot.transfer import pull_snapshot

store_dir, cache_dir, snapshot_id, log_path, go = sys.argv[1:]

class LoggingStore(LocalStore):
    def stream_range(self, blob, start, end):
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"{blob} {start} {end}\\n".encode())
        os.close(fd)
        time.sleep(0.01)  # slow parts keep the pulls overlapping
        return super().stream_range(blob, start, end)

while not os.path.exists(go):
    time.sleep(0.002)
_, stats = pull_snapshot(LoggingStore(store_dir), BlobCache(cache_dir), snapshot_id, concurrency=3,
                         part_size=64 << 10)
print(stats.blobs_downloaded, stats.bytes_downloaded)
"""


def python(script: str, *args: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_processes_pulling_at_once_all_succeed_and_download_each_blob_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    log, go = tmp_path / "reads.log", tmp_path / "go"
    procs = [python(PULL_WORKER, store.root, tmp_path / "cache", built.id, log, go) for _ in range(3)]
    time.sleep(0.3)  # let them start; they all wait for the same moment
    go.touch()
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outputs]
    downloaded = [tuple(map(int, out.split())) for out, _ in outputs]
    assert sum(blobs for blobs, _ in downloaded) == len(built.sizes)
    assert sum(nbytes for _, nbytes in downloaded) == sum(SIZES)
    reads = [(b, int(s), int(e)) for b, s, e in (line.split() for line in log.read_text().splitlines())]
    assert covers_once(reads, built.sizes)
    assert_cache_holds(BlobCache(tmp_path / "cache"), built)


# Push -----------------------------------------------------------------------------------------------------


class RecordingStore(LocalStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[str] = []

    def put_blob(self, blob: str, path: str | os.PathLike[str], **kwargs: object) -> None:
        self.calls.append("blob")
        super().put_blob(blob, path, **kwargs)  # type: ignore[arg-type]

    def put_manifest(self, snapshot_id: str, data: bytes) -> None:
        self.calls.append("manifest")
        super().put_manifest(snapshot_id, data)


def test_push_uploads_only_missing_blobs_and_the_manifest_last(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    first = push_snapshot(store, built.manifest, built.id, built.paths, concurrency=3)
    assert (first.blobs_total, first.blobs_uploaded, first.bytes_uploaded) == (5, 5, sum(SIZES))
    assert store.calls == ["blob"] * 5 + ["manifest"]
    again = push_snapshot(store, built.manifest, built.id, built.paths)
    assert (again.blobs_total, again.blobs_uploaded, again.bytes_uploaded) == (5, 0, 0)
    # A second snapshot sharing all but one blob uploads only that one.
    other = Built(tmp_path / "other", sizes=(*SIZES, 4096), seed=0)
    stats = push_blobs(store, other.paths)
    assert (stats.blobs_uploaded, stats.bytes_uploaded) == (1, 4096)
    assert sorted(store.list_snapshots()) == [built.id]


def test_push_refuses_inconsistent_input(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    with pytest.raises(CorruptBlob, match="does not hash to snapshot"):
        push_snapshot(store, built.manifest, blob_id(b"other"), built.paths)
    missing = dict(list(built.paths.items())[1:])
    with pytest.raises(StoreError, match="needs 1 blob.* not given"):
        push_snapshot(store, built.manifest, built.id, missing)
    gone = dict(built.paths)
    next(iter(gone.values())).unlink()
    with pytest.raises(StoreError, match="is missing; rebuild"):
        push_snapshot(store, built.manifest, built.id, gone)
    assert store.list_snapshots() == [] and list(store.list_blobs()) == []


PUSH_AND_DIE = """
import sys, time
from pathlib import Path
from warmstart.snapshot.store import LocalStore
from warmstart.snapshot.transfer import push_snapshot

store_dir, build_dir, manifest_path, marker = sys.argv[1:]

class StallingStore(LocalStore):
    def put_manifest(self, snapshot_id, data):
        Path(marker).touch()
        time.sleep(60)

raw = Path(manifest_path).read_bytes()
paths = {p.name: p for p in Path(build_dir).iterdir()}
from warmstart.snapshot.format import blob_id
push_snapshot(StallingStore(store_dir), raw, blob_id(raw), paths)
"""


def test_a_push_killed_before_its_manifest_leaves_only_orphans_that_gc_removes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    kept = Built(tmp_path / "kept", sizes=(1000, 2000), seed=7)
    kept.push(store)
    doomed = Built(tmp_path / "doomed", sizes=(3000, 4000, 1000), seed=8)
    (tmp_path / "manifest").write_bytes(doomed.manifest)
    marker = tmp_path / "blobs-pushed"
    proc = python(PUSH_AND_DIE, store.root, tmp_path / "doomed", tmp_path / "manifest", marker)
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert store.list_snapshots() == [kept.id]
    with pytest.raises(NotFound):
        resolve_ref(store, doomed.id)
    orphans = set(doomed.sizes) - set(kept.sizes)
    assert orphans <= {b for b, _, _ in store.list_blobs()}
    young = gc(store, grace_seconds=3600)
    assert (young.blobs_deleted, young.kept, young.kept_in_grace) == (0, 5, 3)
    dry = gc(store, dry_run=True, grace_seconds=0)
    assert (dry.blobs_deleted, dry.bytes_freed) == (3, 8000)
    assert len(list(store.list_blobs())) == 5
    report = gc(store, grace_seconds=0)
    assert (report.blobs_deleted, report.bytes_freed, report.kept) == (3, 8000, 2)
    assert {b for b, _, _ in store.list_blobs()} == set(kept.sizes)
    _, stats = pull_snapshot(store, BlobCache(tmp_path / "cache"), kept.id)
    assert stats.blobs_downloaded == 2


def test_gc_refuses_to_guess_when_a_manifest_is_unreadable(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build", sizes=(10,))
    built.push(store)
    alien = b"\x81\xa6format\xa5other"
    store.put_manifest(blob_id(alien), alien)
    with pytest.raises(StoreError, match="gc stopped, deleting nothing"):
        gc(store, grace_seconds=0)


# Refs -----------------------------------------------------------------------------------------------------


def ids_sharing_a_prefix() -> tuple[bytes, bytes]:
    seen: dict[str, bytes] = {}
    for n in range(100_000):
        raw = Manifest({"format": FORMAT, "format_version": FORMAT_VERSION, "blobs": {}, "n": n}).encode()
        prefix = blob_id(raw)[:4]
        if prefix in seen:
            return seen[prefix], raw
        seen[prefix] = raw
    raise AssertionError("no collision")


def test_resolve_ref(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    one, two = ids_sharing_a_prefix()
    lone = Manifest({"format": FORMAT, "format_version": FORMAT_VERSION, "blobs": {}, "lone": 1}).encode()
    for raw in (one, two, lone):
        store.put_manifest(blob_id(raw), raw)
    store.set_ref("latest", blob_id(one))
    assert resolve_ref(store, blob_id(two)) == blob_id(two)
    assert resolve_ref(store, "latest") == blob_id(one)
    unique = next(blob_id(lone)[:n] for n in range(4, 33) if not blob_id(one).startswith(blob_id(lone)[:n])
                  and not blob_id(two).startswith(blob_id(lone)[:n]))
    assert resolve_ref(store, unique) == blob_id(lone)
    with pytest.raises(StoreError, match=f"prefix '{blob_id(one)[:4]}' is ambiguous .*{blob_id(one)}.*more digits"):
        resolve_ref(store, blob_id(one)[:4])
    with pytest.raises(NotFound, match=r"no snapshot or ref 'prod' in .*refs: latest; snapshots: "):
        resolve_ref(store, "prod")
    with pytest.raises(NotFound, match="at least 4 digits"):
        resolve_ref(store, blob_id(lone)[:3])
    with pytest.raises(NotFound, match="warmstart ls"):
        resolve_ref(store, blob_id(b"absent"))
    with pytest.raises(StoreError, match="no snapshot given"):
        resolve_ref(store, " ")


# Cache and progress ---------------------------------------------------------------------------------------


def test_cache_location_and_admission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARMSTART_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert BlobCache().root == tmp_path / "xdg/warmstart/cache"
    monkeypatch.setenv("WARMSTART_CACHE", str(tmp_path / "env"))
    cache = BlobCache()
    assert cache.root == tmp_path / "env"
    src = tmp_path / "blob"
    src.write_bytes(b"some bytes")
    with pytest.raises(CorruptBlob, match="cannot enter the cache"):
        cache.add_file(blob_id(b"other bytes"), src)
    assert cache.add_file(blob_id(b"some bytes"), src) == cache.path(blob_id(b"some bytes"))
    assert src.exists()
    moved = tmp_path / "moved"
    moved.write_bytes(b"moved bytes")
    cache.add_file(blob_id(b"moved bytes"), moved, move=True)
    assert not moved.exists() and cache.has(blob_id(b"moved bytes"))


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_bytes_and_blobs_on_a_terminal_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    screen = FakeTerminal()
    pull_blobs(store, BlobCache(tmp_path / "a"), built.sizes, progress=Progress("pull", file=screen))
    assert "5/5 blobs" in screen.getvalue() and "B/s" in screen.getvalue()
    quiet = FakeTerminal()
    pull_blobs(store, BlobCache(tmp_path / "b"), built.sizes, progress=Progress("pull", quiet=True, file=quiet))
    assert quiet.getvalue() == ""
    pull_blobs(store, BlobCache(tmp_path / "c"), built.sizes, progress=True)  # stderr is not a terminal here
    assert capsys.readouterr().err == ""


def test_bad_manifests_and_arguments_are_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    cache = BlobCache(tmp_path / "cache")
    with pytest.raises(StoreError, match="lists an invalid blob"):
        pull_blobs(store, cache, {"../../etc/passwd": 10}, snapshot="x")
    with pytest.raises(StoreError, match="lists an invalid blob"):
        pull_blobs(store, cache, {blob_id(b"x"): -1})
    with pytest.raises(ValueError, match="positive"):
        pull_blobs(store, cache, {}, concurrency=0)


# End to end over HTTP -------------------------------------------------------------------------------------


def test_end_to_end_against_a_moto_server(moto_endpoint: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="e2e")
    from warmstart.snapshot.stores import open_store

    store = open_store("s3://e2e/team/models")
    assert isinstance(store, S3Store) and store.endpoint == moto_endpoint
    built = Built(tmp_path / "build")
    first = push_snapshot(store, built.manifest, built.id, built.paths, concurrency=3)
    assert (first.blobs_uploaded, first.bytes_uploaded) == (5, sum(SIZES))
    assert push_snapshot(store, built.manifest, built.id, built.paths).blobs_uploaded == 0
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="e2e")["Contents"]}
    assert f"team/models/snapshots/{built.id}.msgpack" in keys and f"team/models/blobs/{min(built.sizes)}" in keys

    store.set_ref("latest", built.id)
    assert store.list_refs() == {"latest": built.id}
    sid = resolve_ref(store, "latest")
    assert resolve_ref(store, sid[:6]) == sid
    cache = BlobCache(tmp_path / "cache")
    raw, stats = pull_snapshot(store, cache, sid, concurrency=4, part_size=PART)
    assert raw == built.manifest and stats.bytes_downloaded == sum(SIZES)
    assert_cache_holds(cache, built)

    orphan = Built(tmp_path / "orphan", sizes=(777,), seed=3)
    push_blobs(store, orphan.paths)
    assert gc(store, grace_seconds=3600).blobs_deleted == 0
    report = gc(store, grace_seconds=0)
    assert (report.blobs_deleted, report.bytes_freed, report.kept) == (1, 777, 5)
    assert not store.has_blob(next(iter(orphan.sizes)))

    victim = max(built.sizes, key=built.sizes.__getitem__)
    s3.put_object(Bucket="e2e", Key=f"team/models/blobs/{victim}", Body=b"\0" * built.sizes[victim])
    fresh = BlobCache(tmp_path / "fresh")
    with pytest.raises(CorruptBlob, match=f"blob {victim} of snapshot {sid}"):
        pull_snapshot(store, fresh, sid, part_size=PART)
    assert not fresh.has(victim)
    assert_nothing_in_flight(fresh)
    s3.put_object(Bucket="e2e", Key=f"team/models/blobs/{victim}", Body=b"\0" * 100)
    with pytest.raises(CorruptBlob, match="truncated"):
        pull_snapshot(store, fresh, sid, part_size=PART)
    assert_nothing_in_flight(fresh)
