"""S3 through a fault-injecting proxy in front of a moto server: a connection cut mid-body or a 5xx on a ref,
a manifest or a blob part is retried, by a real `warmstart pull` process; a store that keeps cutting is one
clear sentence after bounded retries."""

from __future__ import annotations

import json
import os
import random
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

import warmstart.snapshot.retry as retry_policy
from tests.support.cli import WARMSTART
from tests.support.fault_proxy import Fault, FaultProxy
from warmstart.snapshot.errors import StoreUnreachable
from warmstart.snapshot.format import FORMAT, FORMAT_VERSION, Manifest, blob_id
from warmstart.snapshot.s3 import S3Store

REPO = Path(__file__).resolve().parents[2]
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_MAX_ATTEMPTS",
                 "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    env = {**AWS, "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"), "AWS_EC2_METADATA_DISABLED": "true"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


class Snapshot:
    """A snapshot of random blobs, pushed straight to moto (not through the proxy) under ref 'latest'."""

    def __init__(self, endpoint: str, sizes: tuple[int, ...] = (300_000, 5)) -> None:
        self.bucket = f"faults-{uuid.uuid4().hex[:12]}"
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket=self.bucket)
        rng = random.Random(0)
        self.blobs = {}
        for size in sizes:
            data = rng.randbytes(size)
            self.blobs[blob_id(data)] = data
            s3.put_object(Bucket=self.bucket, Key=f"blobs/{blob_id(data)}", Body=data)
        self.manifest = Manifest({"format": FORMAT, "format_version": FORMAT_VERSION,
                                  "blobs": {b: len(d) for b, d in self.blobs.items()}}).encode()
        self.id = blob_id(self.manifest)
        s3.put_object(Bucket=self.bucket, Key=f"snapshots/{self.id}.msgpack", Body=self.manifest)
        s3.put_object(Bucket=self.bucket, Key="refs/latest", Body=f"{self.id}\n".encode())


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(moto_endpoint) as p:
        yield p


MANIFEST = r"/snapshots/[0-9a-f]{32}\.msgpack$"
REF = r"/refs/latest$"
BLOB = r"/blobs/[0-9a-f]{32}$"


@pytest.mark.parametrize(
    "faults",
    [
        pytest.param([(REF, 1, "cut"), (MANIFEST, 1, "cut")], id="ref-and-manifest-cut"),
        pytest.param([(REF, 1, 500), (BLOB, 1, "cut"), (MANIFEST, 1, "cut"), (MANIFEST, 2, 503)], id="mixed"),
    ],
)
def test_pull_survives_a_connection_cut_mid_body(faults: list[tuple[str, int, Fault]], proxy: FaultProxy,
                                                 moto_endpoint: str, aws_env: dict[str, str],
                                                 tmp_path: Path) -> None:
    snap = Snapshot(moto_endpoint)
    for pattern, nth, fault in faults:
        proxy.fail(pattern, nth=nth, fault=fault)
    env = {**os.environ, **aws_env, "AWS_ENDPOINT_URL": proxy.url, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*WARMSTART, "pull", "latest", "--store", f"s3://{snap.bucket}",
                           "--cache", str(tmp_path / "cache"), "--json"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["id"] == snap.id and result["blobs_downloaded"] == len(snap.blobs)
    for blob, data in snap.blobs.items():
        assert (tmp_path / "cache" / "blobs" / blob).read_bytes() == data
    assert (tmp_path / "cache" / "snapshots" / f"{snap.id}.msgpack").read_bytes() == snap.manifest
    for pattern, nth, _ in faults:
        assert proxy.count(pattern) > nth  # the faulty answer was asked for again


def test_a_store_that_keeps_cutting_the_manifest_fails_in_one_sentence(
        proxy: FaultProxy, moto_endpoint: str, aws_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry_policy, "BACKOFF_SECONDS", 0.001)
    snap = Snapshot(moto_endpoint, sizes=(10,))
    for nth in range(1, 50):
        proxy.fail(MANIFEST, nth=nth, fault="cut")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    with pytest.raises(StoreUnreachable, match=f"snapshot {snap.id} .*try again"):
        S3Store(f"s3://{snap.bucket}").get_manifest(snap.id)
    assert proxy.count(MANIFEST) == 1 + retry_policy.RETRIES
