"""The serverless case as users meet it: a conversation's second turn lands on a new `warmstart serve` process
(an empty pool) and loads the first turn's KV from the tier (S3 on a real moto server, or the local disk after a
restart) instead of computing it, with the same tokens as a server without a tier."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import boto3
import httpx
import pytest
import xxhash

from tests.support.aws import isolate_aws
from tests.support.cli import WARMSTART
from tests.support.fault_proxy import FaultProxy
from tests.support.serving import AUTH, REF, REPO, ServerProcess, TinySnapshot, build_tiny_snapshot

SERVE = ("--num-kv-blocks", "64", "--max-model-len", "256", "--kv-tier-segment-blocks", "2")
KEY = {"WARMSTART_KV_TIER_KEY": "the replicas' shared secret"}  # what signs the segments (an s3 tier needs one)
TURN1 = [(13 * i + 5) % 1000 for i in range(120)]
MORE = [(7 * i + 3) % 1000 for i in range(20)]


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("kv-tier"))


def complete(server: ServerProcess, prompt: list[int]) -> tuple[list[str], int]:
    """Greedy completion of token ids: its tokens (as logprobs name them) and the prompt tokens served cached."""
    body = {"model": REF, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    return choice["logprobs"]["tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith(f"warmstart:{name}"))
    return float(line.rsplit(" ", 1)[1])


def serve(snap: TinySnapshot, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    server = ServerProcess(snap, *SERVE, *args, env=env)
    server.wait_for("ready")
    return server


def second_turn_on_a_fresh_instance(snap: TinySnapshot, tier: tuple[str, ...], env: dict[str, str] | None) -> None:
    plain = serve(snap)
    try:
        reply, _ = complete(plain, TURN1)
        expected, _ = complete(plain, TURN1 + MORE)
    finally:
        plain.stop()
    first = serve(snap, *tier, env=env)
    try:
        assert complete(first, TURN1)[0] == reply
    finally:
        assert first.stop() == 0  # SIGTERM: the queued segments are written before the exit
    second = serve(snap, *tier, env=env)
    try:
        got, cached = complete(second, TURN1 + MORE)
        assert got == expected
        assert cached >= 96  # the first turn's whole segments (2 blocks of 16 tokens each) at least
        assert metric(second, "kv_tier_hit_tokens_total") == cached
        assert metric(second, "kv_tier_faults_total") == 0
        status = httpx.get(f"{second.url}/status", headers=AUTH, timeout=10).json()["kv_tier"]
        assert status["kind"] == tier[1] and status["counters"]["hit_blocks"] * 16 == cached
    finally:
        second.stop()


def test_turn_two_on_a_new_instance_loads_turn_one_from_s3(snap: TinySnapshot, moto_endpoint: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    boto3.client("s3").create_bucket(Bucket="kv-tier-e2e")
    env = {**{k: os.environ[k] for k in os.environ if k.startswith("AWS_")}, **KEY}
    second_turn_on_a_fresh_instance(snap, ("--kv-tier", "s3", "--kv-store", "s3://kv-tier-e2e/tier"), env)
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="kv-tier-e2e")["Contents"]]
    assert keys and all(k.startswith(f"tier/kv/default/{snap.id}/") for k in keys)


def s3_env(bucket: str, endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    boto3.client("s3").create_bucket(Bucket=bucket)
    return {**{k: os.environ[k] for k in os.environ if k.startswith("AWS_")}, **KEY}


def test_a_second_replica_s_first_request_behind_a_shared_document_is_a_tier_hit(
    snap: TinySnapshot, moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = s3_env("kv-tier-replicas", moto_endpoint, tmp_path, monkeypatch)
    tier = ("--kv-tier", "s3", "--kv-store", "s3://kv-tier-replicas/t")
    first, second = serve(snap, *tier, env=env), serve(snap, *tier, env=env)
    try:
        reply, _ = complete(first, TURN1)  # the document, asked about on the first replica
        deadline = time.monotonic() + 30
        while metric(first, "kv_tier_segments_written_total") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # written off the step loop, shortly after
        got, cached = complete(second, TURN1)
        assert got == reply and cached >= 96
    finally:
        first.stop()
        second.stop()


@pytest.mark.parametrize("fault", ["cut", "corrupt"])
def test_a_faulty_s3_tier_costs_a_recompute_and_shows_in_the_metrics(
    fault: str, snap: TinySnapshot, moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = f"kv-tier-{fault}"
    env = s3_env(bucket, moto_endpoint, tmp_path, monkeypatch)
    tier = ("--kv-tier", "s3", "--kv-store", f"s3://{bucket}/t")
    writer = serve(snap, *tier, env=env)
    try:
        reply, _ = complete(writer, TURN1)
    finally:
        writer.stop()
    keys = sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"])
    assert len(keys) >= 3
    with FaultProxy(moto_endpoint) as proxy:
        if fault == "cut":
            proxy.fail(r"/kv/", nth=1, fault="cut")  # the first segment's body is cut midway
        else:
            boto3.client("s3").put_object(Bucket=bucket, Key=keys[0], Body=b"WSKV" + b"\0" * 64)
        reader = serve(snap, *tier, env={**env, "AWS_ENDPOINT_URL": proxy.url})
        try:
            got, cached = complete(reader, TURN1)
            assert got == reply
            assert metric(reader, "kv_tier_faults_total") >= 1
            assert cached < 96  # the run of segments stops at the damaged one (all three would be 96 tokens)
        finally:
            reader.stop()


def test_turn_two_after_a_restart_loads_turn_one_from_the_disk(snap: TinySnapshot, tmp_path: Path) -> None:
    second_turn_on_a_fresh_instance(snap, ("--kv-tier", "disk", "--kv-tier-dir", str(tmp_path / "tier")), None)


@pytest.mark.parametrize(("flags", "message"), [
    (("--kv-tier", "s3"), "--kv-store"),
    (("--kv-store", "s3://b/p"), "--kv-tier is off"),
    (("--kv-tier", "disk", "--kv-tier-namespace", "a/b"), "--kv-tier-namespace"),
    (("--kv-tier", "disk", "--kv-tier-max-bytes", "0"), "--kv-tier-max-bytes"),
    (("--kv-tier", "s3", "--kv-store", "s3://b/p"), "set $WARMSTART_KV_TIER_KEY or give --kv-tier-key-file"),
    (("--kv-tier", "disk", "--kv-tier-key-file", "/no/such/key"), "--kv-tier-key-file /no/such/key: No such file"),
])  # fmt: skip
def test_tier_flags_that_cannot_work_are_refused_before_loading(snap: TinySnapshot, flags: tuple[str, ...],
                                                                message: str) -> None:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "WARMSTART_KV_TIER_KEY"}
    proc = subprocess.run([*WARMSTART, "serve", REF, "--store", str(snap.store), *flags],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


class Blackhole:
    """A TCP endpoint on loopback that accepts connections and never answers: an S3 that stopped responding."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for s in self.held:
            s.close()


def test_a_stop_while_s3_does_not_answer_ends_within_the_grace_period(
    snap: TinySnapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, 9: with --grace-seconds 5 a server printed "stopped" and was alive 60 s later, its tier readers in
    S3 reads of 60 s with retries. Now the tier's calls have request-sized timeouts and every exit is bounded."""
    hole = Blackhole()
    try:
        isolate_aws(monkeypatch, tmp_path)
        env = {**{k: os.environ[k] for k in os.environ if k.startswith("AWS_")}, "AWS_ENDPOINT_URL": hole.url, **KEY}
        server = serve(snap, "--kv-tier", "s3", "--kv-store", "s3://unreachable/t", "--grace-seconds", "1", env=env)
        for _ in range(3):  # lookups that time out: served without the tier
            assert len(complete(server, TURN1)[0]) == 6
        started = time.monotonic()
        code = server.stop()
        took = time.monotonic() - started
        assert code == 0 and took < 1 + 5 + 7 + 3, took  # grace, the cut margin, the exit margin, slack
        assert any(e.get("event") == "stopped" for e in server.events)
    finally:
        hole.close()


def test_a_segment_rewritten_by_someone_without_the_key_is_not_served(snap: TinySnapshot, tmp_path: Path) -> None:
    """Issue 40, 8: rewriting a segment and recomputing its unkeyed checksum changed a fresh server's output. The
    planted KV is now refused (a fault, a recompute) and the output is the tier-less one."""
    tier = ("--kv-tier", "disk", "--kv-tier-dir", str(tmp_path / "tier"))
    plain = serve(snap)
    try:
        expected, _ = complete(plain, TURN1 + MORE)
    finally:
        plain.stop()
    first = serve(snap, *tier)
    try:
        complete(first, TURN1)
    finally:
        assert first.stop() == 0  # the segments are written
    segments = sorted((tmp_path / "tier").rglob("*.kv"))
    assert segments and oct((tmp_path / "tier" / ".key").stat().st_mode & 0o777) == "0o600"
    for path in segments:  # the KV zeroed, and every unkeyed check made to fit (version 1's xxh3 checksum)
        data = path.read_bytes()
        header_len = int.from_bytes(data[4:8], "little")
        header, body = json.loads(data[8 : 8 + header_len]), bytes(len(data) - 8 - header_len)
        if "checksum" in header:
            header["checksum"] = xxhash.xxh3_128_hexdigest(body)
        head = json.dumps(header).encode()
        path.write_bytes(data[:4] + len(head).to_bytes(4, "little") + head + body)
    second = serve(snap, *tier)
    try:
        got, cached = complete(second, TURN1 + MORE)
        assert got == expected and cached == 0
        assert metric(second, "kv_tier_faults_total") >= 1
    finally:
        second.stop()
