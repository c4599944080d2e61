"""Stores: a local directory and S3 (moto in-process) behave alike; errors are one clear sentence, never
holding credentials."""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import (
    BotoCoreError,
    ConnectionClosedError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.stub import Stubber
from moto import mock_aws

import warmstart.snapshot.store as store_module
from warmstart.snapshot.errors import (
    AccessDenied,
    CorruptBlob,
    NoSuchBucket,
    NotFound,
    StoreError,
    StoreUnreachable,
    TransferInterrupted,
)
from warmstart.snapshot.format import FORMAT, FORMAT_VERSION, Manifest, blob_id
from warmstart.snapshot.s3 import S3Store
from warmstart.snapshot.store import LocalStore, Store
from warmstart.snapshot.stores import open_store

ACCESS_KEY = "AKIAFAKEKEYFORTEST01"
SECRET_KEY = "fake/secret+Key0123456789-never-print"
SESSION_TOKEN = "FakeSessionToken0123456789-never-print"
SECRETS = (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN)
BUCKET = "warmstart-test"


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake credentials and no AWS configuration from this machine; nothing may leave loopback."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_MAX_ATTEMPTS",
                 "AWS_RETRY_MODE", "WARMSTART_STORE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        yield LocalStore(tmp_path / "store")
        return
    with mock_aws():
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield S3Store(f"s3://{BUCKET}/some/prefix")


def blob_file(tmp_path: Path, data: bytes) -> tuple[str, Path]:
    path = tmp_path / f"blob-{blob_id(data)}"
    path.write_bytes(data)
    return blob_id(data), path


def manifest(**extra: object) -> bytes:
    return Manifest({"format": FORMAT, "format_version": FORMAT_VERSION, "blobs": {}, **extra}).encode()


def watch_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Everything from warmstart, and what the libraries log at their default levels (botocore's own DEBUG
    output prints request headers; it is off unless a user turns it on)."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="warmstart")


def assert_no_secrets(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


# Round trips ----------------------------------------------------------------------------------------------


def test_blob_round_trip(store: Store, tmp_path: Path) -> None:
    data = os.urandom(100_000)
    bid, path = blob_file(tmp_path, data)
    assert not store.has_blob(bid)
    store.put_blob(bid, path)
    assert store.has_blob(bid)
    assert store.blob_size(bid) == len(data)
    assert store.read_range(bid, 0, len(data)) == data
    assert store.read_range(bid, 1234, 56789) == data[1234:56789]
    assert store.read_range(bid, 10, 10) == b""
    assert b"".join(store.stream_range(bid, 99_000, 100_000)) == data[99_000:]
    [(listed, size, modified)] = list(store.list_blobs())
    assert (listed, size) == (bid, len(data))
    assert abs(modified - time.time()) < 300
    store.delete_blob(bid)
    assert not store.has_blob(bid)
    assert list(store.list_blobs()) == []


def test_put_blob_refuses_a_file_that_does_not_hash_to_its_id(store: Store, tmp_path: Path) -> None:
    bid, path = blob_file(tmp_path, b"the bytes that were built")
    path.write_bytes(b"bytes changed after the build")
    with pytest.raises(CorruptBlob, match="rebuild the snapshot"):
        store.put_blob(bid, path)
    assert not store.has_blob(bid)


def test_missing_and_truncated_blobs(store: Store, tmp_path: Path) -> None:
    bid, path = blob_file(tmp_path, os.urandom(1000))
    with pytest.raises(NotFound, match=f"blob {bid} not found in {store.uri}"):
        store.blob_size(bid)
    with pytest.raises(NotFound, match=bid):
        store.read_range(bid, 0, 10)
    store.put_blob(bid, path)
    with pytest.raises(CorruptBlob, match="truncated"):
        store.read_range(bid, 900, 1100)
    with pytest.raises(CorruptBlob, match="truncated"):
        store.read_range(bid, 2000, 3000)


def test_manifest_round_trip(store: Store) -> None:
    raw = manifest(name="one")
    sid = blob_id(raw)
    assert store.list_snapshots() == []
    assert not store.has_manifest(sid)
    store.put_manifest(sid, raw)
    assert store.has_manifest(sid)
    assert store.get_manifest(sid) == raw
    other = manifest(name="two")
    store.put_manifest(blob_id(other), other)
    assert store.list_snapshots() == sorted([sid, blob_id(other)])


def test_manifest_errors(store: Store) -> None:
    raw = manifest()
    with pytest.raises(CorruptBlob, match="hash"):
        store.put_manifest(blob_id(b"something else"), raw)
    missing = blob_id(b"never pushed")
    with pytest.raises(NotFound, match=f"snapshot {missing} not found in .*warmstart ls --store"):
        store.get_manifest(missing)


def test_refs(store: Store) -> None:
    one, two = manifest(n=1), manifest(n=2)
    for raw in (one, two):
        store.put_manifest(blob_id(raw), raw)
    store.set_ref("latest", blob_id(one))
    store.set_ref("prod_v1.2-rc", blob_id(one))
    assert store.get_ref("latest") == blob_id(one)
    store.set_ref("latest", blob_id(two))
    assert store.list_refs() == {"latest": blob_id(two), "prod_v1.2-rc": blob_id(one)}
    store.delete_ref("latest")
    assert store.list_refs() == {"prod_v1.2-rc": blob_id(one)}
    with pytest.raises(NotFound, match="ref 'latest' not found"):
        store.get_ref("latest")
    with pytest.raises(NotFound, match="ref 'latest' not found"):
        store.delete_ref("latest")
    with pytest.raises(NotFound, match="push it first"):
        store.set_ref("next", blob_id(b"no such snapshot"))


@pytest.mark.parametrize("name, message", [
    ("", "cannot be empty"),
    ("a/b", "slash"),
    ("..", r"'\.\.'"),
    ("v1..2", r"'\.\.'"),
    ("x" * 129, "the limit is 128"),
    (".hidden", "not allowed"),
    ("sp ace", "not allowed"),
])
def test_bad_ref_names_are_refused_clearly(name: str, message: str, tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    raw = manifest()
    store.put_manifest(blob_id(raw), raw)
    with pytest.raises(StoreError, match=message):
        store.set_ref(name, blob_id(raw))
    with pytest.raises(StoreError, match=message):
        store.get_ref(name)
    assert store.list_refs() == {}


@pytest.mark.parametrize("bad", ["../../etc/passwd", "ABCDEF" * 5 + "00", "abc"])
def test_ids_are_checked_before_they_become_paths(bad: str, tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    with pytest.raises(StoreError, match="is not an id"):
        store.has_blob(bad)
    with pytest.raises(StoreError, match="is not an id"):
        store.get_manifest(bad)


# Local store ----------------------------------------------------------------------------------------------


def test_local_writes_leave_no_temporary_files_and_listing_skips_strangers(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    bid, path = blob_file(tmp_path, b"x" * 5000)
    store.put_blob(bid, path)
    raw = manifest()
    store.put_manifest(blob_id(raw), raw)
    store.set_ref("latest", blob_id(raw))
    files = sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file())
    assert files == [f"blobs/{bid}", "refs/latest", f"snapshots/{blob_id(raw)}.msgpack"]
    (store.root / "blobs" / f".{bid}.abc.tmp").write_bytes(b"half")
    (store.root / "refs" / ".tmp").write_text("junk")
    assert [b for b, _, _ in store.list_blobs()] == [bid]
    assert list(store.list_refs()) == ["latest"]


def test_an_empty_or_absent_local_store_lists_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "not-yet")
    assert store.list_snapshots() == [] and store.list_refs() == {} and list(store.list_blobs()) == []


@pytest.mark.parametrize("code, kind, message", [
    (errno.EACCES, AccessDenied, "permission denied while writing blobs/.* into the store .*check the directory"),
    (errno.ENOSPC, StoreError, "the disk is full while writing blobs/.*free some space"),
])
def test_local_os_errors_are_one_sentence(code: int, kind: type[StoreError], message: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    bid, path = blob_file(tmp_path, b"data")
    store = LocalStore(tmp_path / "s")

    def failing_copy(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store_module, "copy_into", failing_copy)
    with pytest.raises(kind, match=message):
        store.put_blob(bid, path)
    assert not store.has_blob(bid)
    assert list((store.root / "blobs").iterdir()) == []  # the temporary file is gone too


# Choosing a store -----------------------------------------------------------------------------------------


def test_open_store_defaults_and_uris(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = open_store(None)
    assert isinstance(default, LocalStore) and default.root == tmp_path / "home/.cache/warmstart/store"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert open_store(None).uri == str(tmp_path / "xdg/warmstart/store")
    monkeypatch.setenv("WARMSTART_STORE", str(tmp_path / "env-store"))
    assert open_store(None).uri == str(tmp_path / "env-store")
    assert open_store(f"file://{tmp_path}/f").uri == f"{tmp_path}/f"
    assert open_store(f"file://localhost{tmp_path}/g").uri == f"{tmp_path}/g"
    assert open_store(str(tmp_path / "plain")).uri == str(tmp_path / "plain")
    s3 = open_store("s3://bucket/a/b/")
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix, s3.uri) == ("bucket", "a/b", "s3://bucket/a/b")
    monkeypatch.setenv("WARMSTART_STORE", "s3://other")
    assert open_store(None).uri == "s3://other"


@pytest.mark.parametrize("uri, message", [
    ("gs://bucket/x", "unsupported store URI scheme 'gs'"),
    ("s3://", "names no bucket"),
    ("file://otherhost/x", "names host"),
    ("   ", "empty"),
    ("s3://bad_bucket!/x", "not a bucket name"),
])
def test_open_store_refuses_bad_uris(uri: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        open_store(uri)


@pytest.mark.parametrize("uri", [f"s3://{ACCESS_KEY}:{SECRET_KEY}@bucket/prefix", f"s3://{ACCESS_KEY}@bucket",
                                 f"s3://{ACCESS_KEY}:{SESSION_TOKEN}@bucket"])
def test_an_s3_uri_with_credentials_is_refused_without_repeating_them(uri: str) -> None:
    with pytest.raises(StoreError, match="takes no credentials") as e:
        open_store(uri)
    assert_no_secrets(str(e.value))


def test_s3_configuration_comes_from_the_aws_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    store = S3Store("s3://b")
    assert store.client.meta.region_name == "eu-west-3"
    assert store.endpoint == "http://127.0.0.1:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9001")
    assert S3Store("s3://b").endpoint == "http://127.0.0.1:9001"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    assert S3Store("s3://b").client.meta.config.retries["total_max_attempts"] == 2


# S3 specifics ---------------------------------------------------------------------------------------------


@mock_aws
def test_large_blobs_upload_in_parts(tmp_path: Path) -> None:
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    five_mib = 5 << 20
    store = S3Store(f"s3://{BUCKET}", transfer_config=TransferConfig(multipart_threshold=five_mib,
                                                                      multipart_chunksize=five_mib))
    data = os.urandom(2 * five_mib + 123)
    bid, path = blob_file(tmp_path, data)
    seen: list[int] = []
    store.put_blob(bid, path, on_bytes=seen.append)
    etag = boto3.client("s3").head_object(Bucket=BUCKET, Key=f"blobs/{bid}")["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart upload of three parts
    assert sum(seen) == len(data)
    assert store.read_range(bid, five_mib - 10, five_mib + 10) == data[five_mib - 10:five_mib + 10]


@mock_aws
def test_a_missing_bucket_is_named(tmp_path: Path) -> None:
    store = S3Store("s3://no-such-bucket/p")
    bid, path = blob_file(tmp_path, b"data")
    for call in (store.list_snapshots, lambda: store.get_manifest(bid), lambda: store.get_ref("latest"),
                 lambda: store.put_blob(bid, path), lambda: list(store.list_blobs())):
        with pytest.raises(NoSuchBucket, match="bucket 'no-such-bucket' does not exist .*create it"):
            call()


def client_errors() -> list[tuple[str, int, type[StoreError], str]]:
    return [
        ("AccessDenied", 403, AccessDenied, "was denied .*s3:GetObject"),
        ("InvalidAccessKeyId", 403, AccessDenied, "rejected the AWS credentials"),
        ("SignatureDoesNotMatch", 403, AccessDenied, "rejected the AWS credentials"),
        ("ExpiredToken", 400, AccessDenied, "rejected the AWS credentials"),
        ("NoSuchKey", 404, NotFound, "not found"),
        ("NoSuchBucket", 404, NoSuchBucket, "does not exist"),
        ("SlowDown", 503, StoreUnreachable, "kept failing .*try again later"),
        ("InternalError", 500, StoreUnreachable, "kept failing"),
        ("AuthorizationHeaderMalformed", 400, StoreError, "another region .*AWS_REGION"),
        ("WeirdNewCode", 400, StoreError, "refused"),
    ]


@pytest.mark.parametrize("code, status, kind, message", client_errors())
def test_s3_errors_map_to_clear_store_errors(code: str, status: int, kind: type[StoreError], message: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    watch_logs(caplog)
    store = S3Store("s3://bucket/p")
    sid = blob_id(b"x")
    with Stubber(store.client) as stub:
        stub.add_client_error("get_object", service_error_code=code, http_status_code=status,
                              service_message=f"details with {ACCESS_KEY} and {SECRET_KEY}",
                              response_meta={"AWSAccessKeyId": ACCESS_KEY})
        with pytest.raises(kind, match=message) as e:
            store.get_manifest(sid)
    assert type(e.value) is kind
    assert_no_secrets(str(e.value))
    assert_no_secrets(caplog.text)


def test_an_unreachable_endpoint_is_one_sentence(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    watch_logs(caplog)
    with socket.socket() as s:  # a port that was free a moment ago: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    store = S3Store("s3://bucket/p")
    with pytest.raises(StoreUnreachable, match=f"cannot reach the S3 endpoint http://127.0.0.1:{port} for "
                                               "s3://bucket/p; check the network and AWS_ENDPOINT_URL") as e:
        store.list_snapshots()
    assert_no_secrets(str(e.value))
    assert_no_secrets(caplog.text)


def test_no_credentials_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(AccessDenied, match="no usable AWS credentials for s3://bucket; set AWS_ACCESS_KEY_ID"):
        S3Store("s3://bucket").has_blob(blob_id(b"x"))


@mock_aws
def test_credentials_rejected_by_the_server() -> None:
    from moto.core import set_initial_no_auth_action_count

    @set_initial_no_auth_action_count(0)
    def attempt() -> None:
        S3Store("s3://bucket").list_snapshots()

    with pytest.raises(AccessDenied) as e:
        attempt()
    assert "rejected the AWS credentials (InvalidAccessKeyId)" in str(e.value)
    assert_no_secrets(str(e.value))


def test_unexpected_botocore_messages_are_redacted() -> None:
    class Leaky(BotoCoreError):
        fmt = "failed at https://x/?X-Amz-Credential={key}&X-Amz-Signature=abc with secret {secret}"

    store = S3Store("s3://bucket")
    error = store._error(Leaky(key=ACCESS_KEY, secret=SECRET_KEY), "blob x")
    assert "failed at" in str(error)
    assert_no_secrets(str(error))
    assert "X-Amz-Signature=abc" not in str(error)


@pytest.mark.parametrize("error", [
    IncompleteReadError(actual_bytes=10, expected_bytes=20),
    ResponseStreamingError(error="connection reset"),
    ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    ConnectionClosedError(endpoint_url="http://127.0.0.1:1"),
])
def test_a_body_cut_midway_is_a_resumable_interruption(error: Exception) -> None:
    store = S3Store("s3://bucket")

    class Body:
        def read(self, size: int = -1) -> bytes:
            raise AssertionError("the store streams, it does not read whole")

        def iter_chunks(self, size: int) -> Iterator[bytes]:
            yield b"x" * 10
            raise error

        def close(self) -> None:
            pass

    with Stubber(store.client) as stub:
        stub.add_response("get_object", {"Body": Body(), "ContentLength": 20}, {"Bucket": "bucket",
                                                                               "Key": "blobs/" + "0" * 32,
                                                                               "Range": "bytes=0-19"})
        pieces = store.stream_range("0" * 32, 0, 20)
        assert next(pieces) == b"x" * 10
        with pytest.raises(TransferInterrupted, match="try again"):
            next(pieces)


def test_links_out_of_the_store_are_never_followed_and_bad_pointers_never_echoed(tmp_path: Path) -> None:
    """Issue 40, 12: a ref replaced by a link to a file outside, a refs folder linked outside (reads and writes), and
    a ref holding text that is no id: each refused, and no error repeats what the file says. A link that stays
    inside the store is followed as before."""
    from warmstart.snapshot.errors import StoreError
    from warmstart.snapshot.format import blob_id
    from warmstart.snapshot.stores import open_store

    store = open_store(str(tmp_path / "store"))
    sid = blob_id(b"{}")
    store.put_manifest(sid, b"{}")
    store.set_ref("good", sid)
    outside = tmp_path / "passwd"
    outside.write_text("root:x:0:0:root:/root:/bin/bash\n")
    refs = tmp_path / "store" / "refs"
    (refs / "spy").symlink_to(outside)
    (refs / "alias").symlink_to(refs / "good")  # inside the store
    (refs / "junk").write_text("root:x:0:0 is no id\n")
    assert store.get_ref("alias") == sid
    with pytest.raises(StoreError, match="is a link that leads out of the store") as spy:
        store.get_ref("spy")
    with pytest.raises(StoreError, match="does not hold a snapshot id") as junk:
        store.get_ref("junk")
    assert "root:" not in str(spy.value) + str(junk.value)
    good, bad = store.survey_refs()
    assert good == {"good": sid} and set(bad) == {"junk"} and "root:" not in bad["junk"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stolen").write_text(f"{sid}\n")
    other = open_store(str(tmp_path / "other"))
    other.put_manifest(sid, b"{}")
    (tmp_path / "other" / "refs").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(StoreError, match="leads out of the store"):
        other.get_ref("stolen")
    with pytest.raises(StoreError, match="leads out of the store"):
        other.set_ref("planted", sid)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["stolen"]
