"""Damaged blobs are found and replaced, wherever they are: in the local cache (pull, load, `warmstart
verify`), in the store (push), in the build cache (build); and gc cannot delete the blobs of a snapshot being
pushed. Each runs against a local store and a moto S3 server on 127.0.0.1 where a store is involved."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest

import warmstart.snapshot.transfer as transfer_module
from tests.support.aws import isolate_aws
from tests.support.blobs import Built
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.errors import NotFound
from warmstart.snapshot.format import file_blob_id
from warmstart.snapshot.gc import gc
from warmstart.snapshot.s3 import S3Store
from warmstart.snapshot.store import LocalStore, Store
from warmstart.snapshot.transfer import pull_blobs, pull_snapshot, push_blobs, push_snapshot
from warmstart.snapshot.verify import verify_cache, verify_snapshot

_buckets = itertools.count()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setattr(transfer_module, "BACKOFF_SECONDS", 0.001)


@pytest.fixture(params=["local", "s3"])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("moto_endpoint"))
    yield request.param


def new_store(kind: str, tmp_path: Path, cls: type[Store] | None = None) -> Store:
    """An empty store of that kind (a fresh bucket on the moto server for s3), as ``cls`` when given."""
    if kind == "local":
        return (cls or LocalStore)(tmp_path / "store")  # type: ignore[call-arg]
    bucket = f"integrity-{os.getpid()}-{next(_buckets)}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return (cls or S3Store)(f"s3://{bucket}/snaps")  # type: ignore[call-arg]


def overwrite_store_blob(store: Store, blob: str, data: bytes) -> None:
    """What another tool (or a disk) does to a stored blob: new bytes under the same key, no checksum."""
    if isinstance(store, LocalStore):
        (store.root / "blobs" / blob).write_bytes(data)
    else:
        assert isinstance(store, S3Store)
        store.client.put_object(Bucket=store.bucket, Key=store._key(f"blobs/{blob}"), Body=data)


DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "nan": lambda data: b"\xff\xc0" * (len(data) // 2) + data[: len(data) % 2],  # bf16 NaNs, the same size
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
}


def damage(path: Path, how: str) -> None:
    """Damage a cached file in place, as a tool writing into the cache would (same inode)."""
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(DAMAGE[how](data))
        f.truncate()


# The local cache ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", DAMAGE)
def test_pull_finds_a_damaged_cached_blob_and_downloads_it_again(how: str, kind: str, tmp_path: Path) -> None:
    store = new_store(kind, tmp_path)
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    pull_snapshot(store, cache, built.id, part_size=64 << 10)
    victim = max(built.sizes, key=built.sizes.__getitem__)
    damage(cache.path(victim), how)

    _, stats = pull_snapshot(store, cache, built.id, part_size=64 << 10)
    assert (stats.blobs_replaced, stats.blobs_downloaded, stats.bytes_downloaded) == (1, 1, built.sizes[victim])
    assert all(file_blob_id(cache.path(b)) == b for b in built.sizes)
    assert list((cache.root / "locks").iterdir()) == [] and list((cache.root / "tmp").iterdir()) == []


def test_a_load_checks_sizes_only_a_pull_checks_hashes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    pull_snapshot(store, cache, built.id)
    nan, short = sorted(built.sizes, key=built.sizes.__getitem__)[-2:]
    damage(cache.path(nan), "nan")
    damage(cache.path(short), "truncated")
    # What a cold start does: sizes only (the same-size damage stays for `pull` and `verify` to find).
    stats = pull_blobs(store, cache, built.sizes, verify_cached=False)
    assert (stats.blobs_replaced, stats.blobs_downloaded) == (1, 1)
    assert file_blob_id(cache.path(short)) == short and file_blob_id(cache.path(nan)) != nan
    stats = pull_blobs(store, cache, built.sizes)
    assert (stats.blobs_replaced, stats.blobs_downloaded) == (1, 1)
    assert file_blob_id(cache.path(nan)) == nan


def test_discard_leaves_a_blob_that_was_replaced_since_it_was_found_bad(tmp_path: Path) -> None:
    built = Built(tmp_path / "build", sizes=(1000,))
    (blob, path), = built.paths.items()
    cache = BlobCache(tmp_path / "cache")
    cache.add_file(blob, path)
    damage(cache.path(blob), "nan")
    bad = cache.find_bad(blob, 1000)
    assert bad is not None and "hash to" in bad.problem
    cache.add_file(blob, path)  # a pull renamed a verified copy into place meanwhile
    assert not cache.discard(bad)
    assert cache.find_bad(blob, 1000) is None
    assert cache.find_bad(blob, 999) is not None and "999" in cache.find_bad(blob, 999).problem  # type: ignore[union-attr]


def test_verify_reports_damaged_blobs_and_downloads_them_again(kind: str, tmp_path: Path) -> None:
    store = new_store(kind, tmp_path)
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    pull_snapshot(store, cache, built.id)
    stray = Built(tmp_path / "stray", sizes=(3000,), seed=5)  # in the cache, listed by no cached snapshot
    (stray_id, stray_path), = stray.paths.items()
    cache.add_file(stray_id, stray_path)
    blobs = sorted(b for b in built.sizes if built.sizes[b] > 1)
    damage(cache.path(blobs[0]), "nan")
    damage(cache.path(blobs[1]), "empty")
    damage(cache.path(stray_id), "truncated")

    report = verify_cache(cache, lambda: store)
    assert report.blobs_checked == len(built.sizes) + 1 and not report.failed
    found = {b["blob"]: b for b in report.bad}
    assert set(found) == {blobs[0], blobs[1], stray_id}
    assert "hash to" in found[blobs[0]]["problem"] and "manifest says" in found[blobs[1]]["problem"]
    assert found[blobs[0]]["action"].startswith("downloaded again") and found[stray_id]["action"].startswith("removed")
    assert all(file_blob_id(cache.path(b)) == b for b in built.sizes) and not cache.has(stray_id)

    again = verify_snapshot(cache, built.id, built.manifest, lambda: store)
    assert again.bad == [] and again.blobs_checked == len(built.sizes) and again.blobs_missing == 0


def test_verify_without_the_store_removes_what_it_cannot_fetch_again(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    pull_snapshot(store, cache, built.id)
    victim = max(built.sizes, key=built.sizes.__getitem__)
    damage(cache.path(victim), "nan")
    report = verify_snapshot(cache, built.id, built.manifest, lambda: LocalStore(tmp_path / "elsewhere"))
    assert [b["blob"] for b in report.bad] == [victim] and len(report.failed) == 1
    assert "not found" in report.bad[0]["action"] and not cache.has(victim)  # never served again
    assert pull_snapshot(store, cache, built.id)[1].blobs_downloaded == 1


# The store ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["nan", "truncated"])
def test_push_again_replaces_a_damaged_store_blob(how: str, kind: str, tmp_path: Path) -> None:
    store = new_store(kind, tmp_path)
    built = Built(tmp_path / "build")
    built.push(store)
    victim = max(built.sizes, key=built.sizes.__getitem__)
    overwrite_store_blob(store, victim, DAMAGE[how](built.paths[victim].read_bytes()))
    with pytest.raises(Exception, match="push the snapshot again"):
        pull_snapshot(store, BlobCache(tmp_path / "before"), built.id)

    stats = push_snapshot(store, built.manifest, built.id, built.paths)
    assert (stats.blobs_uploaded, stats.blobs_replaced, stats.bytes_uploaded) == (1, 1, built.sizes[victim])
    assert stats.blobs_refreshed == len(built.sizes) - 1
    cache = BlobCache(tmp_path / "after")
    assert pull_snapshot(store, cache, built.id)[1].blobs_downloaded == len(built.sizes)
    assert push_snapshot(store, built.manifest, built.id, built.paths).blobs_uploaded == 0


def test_s3_blobs_carry_their_checksum_as_metadata(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from boto3.s3.transfer import TransferConfig
    from moto import mock_aws

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)

    with mock_aws():
        boto3.client("s3").create_bucket(Bucket="meta")
        config = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
        store = S3Store("s3://meta", transfer_config=config)
        built = Built(tmp_path / "build", sizes=(100, 11 << 20))  # one plain upload, one multipart
        built.push(store)
        for blob, size in built.sizes.items():
            head = store.client.head_object(Bucket="meta", Key=f"blobs/{blob}")
            assert head["Metadata"] == {"xxh3": blob} and store.blob_matches(blob, size)
            assert store.refresh_blob(blob)
            assert store.client.head_object(Bucket="meta", Key=f"blobs/{blob}")["Metadata"] == {"xxh3": blob}
            assert store.blob_matches(blob, size + 1) is False
        assert store.blob_matches("0" * 32, 1) is None and not store.refresh_blob("0" * 32)


def test_a_rebuild_replaces_a_damaged_build_cache_entry(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from warmstart.snapshot.build import BuildOptions, build_snapshot

    cache = BlobCache(tmp_path / "cache")
    first = build_snapshot(tiny_model_dir("llama"), BuildOptions(dtype="float32"), cache)
    weights = sorted({t["blob"] for t in first.manifest.data["tensors"].values()})
    damage(cache.path(weights[0]), "nan")
    damage(cache.path(weights[1]), "truncated")

    again = build_snapshot(tiny_model_dir("llama"), BuildOptions(dtype="float32"), cache)
    assert again.id == first.id
    assert all(file_blob_id(cache.path(b)) == b for b in again.blob_paths)
    stats = push_snapshot(LocalStore(tmp_path / "store"), again.manifest.encode(), again.id, again.blob_paths)
    assert stats.blobs_uploaded == len(again.blob_paths)


# gc against a push --------------------------------------------------------------------------------------


class StaleView(Store):
    """A gc's view of the store: the listings it took before a push began; reads and deletes go to the store."""

    def __init__(self, store: Store) -> None:
        self.store, self.uri = store, store.uri
        self.blobs = [(b, size, 0.0) for b, size, _ in store.list_blobs()]  # as a listing long after a crash
        self.snapshots = store.list_snapshots()

    def list_blobs(self) -> Iterator[tuple[str, int, float]]:
        return iter(self.blobs)

    def list_snapshots(self) -> list[str]:
        return self.snapshots

    def get_manifest(self, snapshot_id: str) -> bytes:
        return self.store.get_manifest(snapshot_id)

    def list_loras(self) -> dict[tuple[str, str], str]:
        return self.store.list_loras()

    def delete_blob(self, blob: str) -> None:
        self.store.delete_blob(blob)

    def delete_blob_if_older(self, blob: str, cutoff: float) -> bool:
        return self.store.delete_blob_if_older(blob, cutoff)

    _size = _put_file = _put_bytes = _get_bytes = _stream = _list = _delete = None  # type: ignore[assignment]
    _blob_matches = _touch = _delete_if_older = None  # type: ignore[assignment]


def crashed_push(store: Store, built: Built) -> None:
    """The blobs of a push that died before its manifest, long ago (where the store lets us say so)."""
    push_blobs(store, built.paths)
    if isinstance(store, LocalStore):
        for blob in built.sizes:
            os.utime(store.root / "blobs" / blob, (time.time() - 7200, time.time() - 7200))


def test_gc_racing_a_push_that_reuses_old_blobs_leaves_the_snapshot_whole(kind: str, tmp_path: Path) -> None:
    store = new_store(kind, tmp_path)
    built = Built(tmp_path / "build")
    crashed_push(store, built)
    gc_view = StaleView(store)  # gc listed blobs and snapshots here: the push's blobs old and unreferenced

    push_snapshot(store, built.manifest, built.id, built.paths)
    report = gc(gc_view, grace_seconds=3600)  # ...and deletes now, after the push wrote its manifest

    assert report.blobs_deleted == 0 and report.kept_in_grace == len(built.sizes)
    assert pull_snapshot(store, BlobCache(tmp_path / "cache"), built.id)[1].blobs_downloaded == len(built.sizes)


def test_an_s3_push_refreshes_the_age_of_the_blobs_it_reuses(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    store = new_store("s3", tmp_path)
    built = Built(tmp_path / "build")
    crashed_push(store, built)
    before = {b: m for b, _, m in store.list_blobs()}
    time.sleep(1.1)  # S3's LastModified counts whole seconds
    stats = push_snapshot(store, built.manifest, built.id, built.paths)
    assert (stats.blobs_uploaded, stats.blobs_refreshed) == (0, len(built.sizes))
    assert all(m > before[b] for b, _, m in store.list_blobs())


def test_a_blob_deleted_after_its_refresh_is_uploaded_again_before_the_manifest(kind: str, tmp_path: Path) -> None:
    base = LocalStore if kind == "local" else S3Store
    deleted: list[str] = []
    once = threading.Lock()

    def refresh_then_lose(self: Store, blob: str) -> bool:  # a gc deletes one right after its refresh
        ok = base.refresh_blob(self, blob)
        with once:
            if not deleted:
                self.delete_blob(blob)
                deleted.append(blob)
        return ok

    racing = type("RacingStore", (base,), {"refresh_blob": refresh_then_lose})
    store = new_store(kind, tmp_path, racing)
    built = Built(tmp_path / "build")
    push_blobs(store, built.paths)

    stats = push_snapshot(store, built.manifest, built.id, built.paths)
    assert deleted and stats.blobs_uploaded == 1
    assert pull_snapshot(store, BlobCache(tmp_path / "cache"), built.id)[1].blobs_downloaded == len(built.sizes)


def test_gc_still_deletes_old_unreferenced_blobs(kind: str, tmp_path: Path) -> None:
    store = new_store(kind, tmp_path)
    orphan = Built(tmp_path / "orphan", sizes=(500, 600), seed=4)
    crashed_push(store, orphan)
    if kind == "local":
        assert gc(store, grace_seconds=3600).blobs_deleted == 2
    else:  # S3 ages cannot be set back: a grace of 0 makes every unreferenced blob old
        assert gc(store, grace_seconds=0).blobs_deleted == 2
    with pytest.raises(NotFound):
        store.blob_size(next(iter(orphan.sizes)))


def test_the_verify_command_reports_then_fails_in_one_sentence_when_it_cannot_fetch_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from warmstart.handlers.cli.main import main

    store = LocalStore(tmp_path / "store")
    built = Built(tmp_path / "build")
    built.push(store)
    cache = BlobCache(tmp_path / "cache")
    pull_snapshot(store, cache, built.id)
    victim = max(built.sizes, key=built.sizes.__getitem__)
    damage(cache.path(victim), "nan")

    args = ["--cache", str(cache.root), "--json"]
    assert main(["verify", built.id[:8], "--store", str(tmp_path / "empty"), *args]) == 1  # the prefix: not there
    assert "no snapshot or ref" in capsys.readouterr().err
    assert main(["verify", built.id, "--store", str(tmp_path / "empty"), *args]) == 1  # cached: no store needed
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    assert [b["blob"] for b in report["bad"]] == [victim] and not cache.has(victim)
    assert err.startswith("warmstart: error: 1 damaged blob(s) were removed") and "Traceback" not in err
    assert main(["verify", built.id[:8], "--store", str(store.root), *args]) == 0
    assert json.loads(capsys.readouterr().out)["bad"] == []  # removed, so nothing damaged is left to find
    assert main(["pull", built.id, "--store", str(store.root), *args]) == 0
    assert json.loads(capsys.readouterr().out)["blobs_downloaded"] == 1
    main(["verify", "--store", str(store.root), "--cache", str(cache.root)])
    assert "all whole" in capsys.readouterr().out
