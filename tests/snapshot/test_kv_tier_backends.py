"""The KV tier's backends: a bounded local directory (LRU, survives a restart) and the snapshot store (local
and S3 over a real moto server)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import boto3
import pytest

from tests.support.aws import isolate_aws
from warmstart.snapshot.kv_tier_backends import DiskBackend, StoreBackend
from warmstart.snapshot.store import LocalStore
from warmstart.snapshot.stores import open_store


def test_disk_keeps_the_most_recently_used_within_its_budget(tmp_path: Path) -> None:
    disk = DiskBackend(tmp_path / "tier", max_bytes=250)
    for name in "abc":
        disk.put(f"ns/m/-/l/{name}", name.encode() * 100)
        time.sleep(0.01)
    assert disk.get("ns/m/-/l/a") is None  # three of 100 bytes do not fit 250: the oldest went
    assert disk.get("ns/m/-/l/b") == b"b" * 100  # b is now the most recently used
    time.sleep(0.01)
    disk.put("ns/m/-/l/d", b"d" * 100)
    assert disk.get("ns/m/-/l/c") is None and disk.get("ns/m/-/l/b") is not None
    assert disk.bytes_stored <= 250


def test_disk_survives_a_restart_and_ignores_cut_writes(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    DiskBackend(root, max_bytes=10_000).put("ns/m/-/l/x", b"kv" * 10)
    (root / "ns" / "m" / "-" / "l" / ".y.kv.1234.tmp").write_bytes(b"half")  # a write killed midway
    again = DiskBackend(root, max_bytes=10_000)
    assert again.get("ns/m/-/l/x") == b"kv" * 10 and again.get("ns/m/-/l/y") is None
    assert again.bytes_stored == 20
    assert oct(os.stat(root).st_mode & 0o777) == "0o700"  # users' conversations: the serving user's alone


def modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")]}


def test_disk_files_are_the_serving_users_alone_and_an_existing_wide_directory_is_tightened(tmp_path: Path) -> None:
    """Issue 40, 7: an existing 0755 --kv-tier-dir held 0644 segments in 0755 folders."""
    root = tmp_path / "tier"
    (root / "ns" / "m").mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    (root / "ns" / "m" / "old.kv").write_bytes(b"old")
    os.chmod(root / "ns" / "m" / "old.kv", 0o644)
    umask = os.umask(0o022)  # the usual one, under which mkdir and open leave others read access
    try:
        disk = DiskBackend(root, max_bytes=10_000)
        disk.put("ns/m/-/l/new", b"kv")
    finally:
        os.umask(umask)
    assert modes(root) == {".": "0o700", "ns": "0o700", "ns/m": "0o700", "ns/m/old.kv": "0o600", "ns/m/-": "0o700",
                           "ns/m/-/l": "0o700", "ns/m/-/l/new.kv": "0o600"}  # fmt: skip
    assert disk.get("ns/m/old") == b"old" and disk.get("ns/m/-/l/new") == b"kv"


def test_a_wide_directory_of_another_user_is_refused_saying_why(tmp_path: Path) -> None:
    from warmstart.snapshot.errors import StoreError

    root = tmp_path / "tier"
    (root / "theirs").mkdir(parents=True, mode=0o700)
    os.chmod(root / "theirs", 0o755)
    if os.geteuid() == 0:  # root can hand the folder to another user; others make the case with their own folder
        os.chown(root / "theirs", 65534, 65534)
        with pytest.raises(StoreError, match=r"which others can read \(mode 755\) and which belongs to another user"):
            DiskBackend(root, max_bytes=1_000)
    else:
        DiskBackend(root, max_bytes=1_000)
        assert modes(root)["theirs"] == "0o700"


def test_two_instances_sharing_a_directory_keep_one_budget_between_them(tmp_path: Path) -> None:
    """Issue 40, 10: each counted only its own writes, so two held twice the budget."""
    root = tmp_path / "tier"
    first, second = (DiskBackend(root, max_bytes=1_000, rescan_seconds=0) for _ in range(2))
    for i in range(10):
        first.put(f"ns/m/-/l/a{i}", b"a" * 100)
        time.sleep(0.002)
        second.put(f"ns/m/-/l/b{i}", b"b" * 100)
        time.sleep(0.002)
    held = sum(p.stat().st_size for p in root.rglob("*.kv"))
    assert held <= 1_000, held
    assert second.get("ns/m/-/l/b9") == b"b" * 100 and first.get("ns/m/-/l/a0") is None  # oldest out, whoever wrote


def test_disk_shrinks_to_a_smaller_budget_at_start(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    first = DiskBackend(root, max_bytes=1_000)
    for i in range(5):
        first.put(f"ns/m/-/l/{i}", b"x" * 100)
    assert DiskBackend(root, max_bytes=250).bytes_stored == 200


@pytest.mark.parametrize("key", ["../escape", "ns/../../x", "/abs"])
def test_names_cannot_leave_the_tier(tmp_path: Path, key: str) -> None:
    disk = DiskBackend(tmp_path / "tier", max_bytes=1_000)
    with pytest.raises(ValueError, match="not a KV segment name"):
        disk.put(key, b"x")
    with pytest.raises(ValueError, match="not a KV segment name"):
        LocalStore(tmp_path / "store").put_kv_segment(key, b"x")


def test_store_backend_on_a_local_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    backend = StoreBackend(store)
    assert backend.get("ns/m/-/l/abc") is None
    backend.put("ns/m/-/l/abc", b"segment")
    assert backend.get("ns/m/-/l/abc") == b"segment"
    assert (tmp_path / "store" / "kv" / "ns" / "m" / "-" / "l" / "abc").read_bytes() == b"segment"


def test_store_backend_on_s3_over_a_moto_server(moto_endpoint: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    boto3.client("s3").create_bucket(Bucket="kv-tier")
    backend = StoreBackend(open_store("s3://kv-tier/team"))
    assert backend.get("ns/m/-/l/abc") is None
    backend.put("ns/m/-/l/abc", b"segment" * 1000)
    assert backend.get("ns/m/-/l/abc") == b"segment" * 1000
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="kv-tier")["Contents"]]
    assert keys == ["team/kv/ns/m/-/l/abc"]
