"""The serverless case of the KV tier: a conversation's next turn lands on a new instance. Time to first token of
that turn on a fresh `warmstart serve` process with the KV tier (S3 on a moto server on 127.0.0.1) against a
fresh process without it, side by side.

    python -m benchmarks.kv_tier [--rounds 3] [--history 4096] [--model-dir DIR] [--json OUT]

Once: a bf16 snapshot of the model (SmolLM2-135M-Instruct from `warmstart prepare-model smollm2` when it is
there, else the random SmolLM2-135M-shaped model) in a local store, and a moto S3 server. Each round draws a
fresh history of --history token ids (so no round finds another's segments) and:
1. turn one: a server with the tier computes the history (max_tokens 1) and is stopped (SIGTERM: it writes its
   queued segments before exiting);
2. turn two, the history plus 32 new tokens, on a fresh server with the tier and on a fresh server without it,
   the order alternating from round to round; each is timed from sending the request to its one-token reply
   (the server already ready: what the turn costs, not the cold start).
Printed: medians, the ratio (without / with), the tokens served from the tier and the bytes it read per token.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import harness
from benchmarks.cold_start import AWS, free_port, stop
from benchmarks.workloads import REPO, SHARED_BENCH

PREPARED = Path.home() / ".cache" / "warmstart" / "models" / "smollm2"
NEW_TOKENS = 32


def model_dir(given: Path | None) -> Path:
    if given is not None:
        return given
    if (PREPARED / ".prepared").is_file() or (PREPARED / "config.json").is_file():
        return PREPARED
    from benchmarks.throughput import model_dir as bench_model_dir

    return bench_model_dir(SHARED_BENCH / "models" / "smollm2-135m.json")


def build(model: Path, work: Path) -> str:
    from warmstart.snapshot.build import BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.stores import open_store
    from warmstart.snapshot.transfer import push_snapshot

    built = build_snapshot(model, BuildOptions(dtype="bfloat16"), BlobCache(work / "cache"))
    push_snapshot(open_store(str(work / "store")), built.manifest.encode(), built.id, built.blob_paths)
    return built.id


class Server:
    def __init__(self, sid: str, work: Path, tier: bool, env: dict[str, str]) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "warmstart.handlers.cli", "serve", sid, "--store", str(work / "store"), "--cache",
               str(work / "cache"), "--port", str(self.port), "--max-model-len", "8192"]
        if tier:
            cmd += ["--kv-tier", "s3", "--kv-store", "s3://bench/kv"]
            env = {**env, "WARMSTART_KV_TIER_KEY": "benchmark key, 16 bytes or more"}
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]!r}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("serve not ready after 300 s")
            time.sleep(0.02)

    def complete(self, prompt: list[int]) -> tuple[float, dict[str, Any]]:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        r = httpx.post(f"{self.base}/v1/completions", json=body, timeout=600)
        seconds = time.perf_counter() - start
        r.raise_for_status()
        return seconds, r.json()["usage"]

    def counter(self, name: str) -> float:
        for line in httpx.get(f"{self.base}/metrics", timeout=10).text.splitlines():
            if line.startswith(f"warmstart:{name}"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        stop(self.proc)


def round_once(sid: str, work: Path, env: dict[str, str], history: int, vocab: int, seed: int,
               tier_first: bool) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    turn1 = [rng.randrange(100, vocab - 100) for _ in range(history)]
    turn2 = turn1 + [rng.randrange(100, vocab - 100) for _ in range(NEW_TOKENS)]
    writer = Server(sid, work, True, env)
    try:
        writer.complete(turn1)
    finally:
        writer.stop()
    out: dict[str, Any] = {}
    for tier in (True, False) if tier_first else (False, True):
        server = Server(sid, work, tier, env)
        try:
            seconds, usage = server.complete(turn2)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            out["with_tier" if tier else "without"] = {"ttft_s": seconds, "cached_tokens": cached}
            if tier:
                out["with_tier"]["bytes_read"] = server.counter("kv_tier_read_bytes_total")
                out["with_tier"]["faults"] = server.counter("kv_tier_faults_total")
        finally:
            server.stop()
    return out


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3)
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--model-dir", type=Path)
    args = harness.parse(ap)

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://{host}:{port}", **AWS,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    os.environ.update(AWS_ENDPOINT_URL=env["AWS_ENDPOINT_URL"], **AWS)
    boto3.client("s3").create_bucket(Bucket="bench")
    model = model_dir(args.model_dir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rounds = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            sid = build(model, work)
            for r in range(args.rounds):
                rounds.append(round_once(sid, work, env, args.history, vocab, seed=r, tier_first=r % 2 == 0))
                print(json.dumps(rounds[-1]), file=sys.stderr)
    finally:
        moto.stop()
    with_tier = harness.median(r["with_tier"]["ttft_s"] for r in rounds)
    without = harness.median(r["without"]["ttft_s"] for r in rounds)
    ratio = harness.ratio([r["without"]["ttft_s"] for r in rounds], [r["with_tier"]["ttft_s"] for r in rounds])
    cached = harness.median(r["with_tier"]["cached_tokens"] for r in rounds)
    per_token = harness.median(r["with_tier"]["bytes_read"] / max(1, r["with_tier"]["cached_tokens"]) for r in rounds)
    report = {"model": str(model), "history": args.history, "rounds": rounds, "ttft_with_tier_s": with_tier,
              "ttft_without_s": without, "without_over_with_tier": ratio, "cached_tokens": cached,
              "bytes_read_per_cached_token": per_token}
    print(f"turn two after a {args.history}-token history, on a fresh process ({model.name}, bf16, "
          f"{args.rounds} rounds)")
    print(f"  with the KV tier (S3, moto)   TTFT {with_tier:.3f} s   ({cached:.0f} tokens from the tier, "
          f"{per_token / 1024:.1f} KiB read per token)")
    print(f"  without                       TTFT {without:.3f} s")
    print(f"  ratio (without / with)        {harness.ratio_text(ratio)}")
    harness.report(args, report)


if __name__ == "__main__":
    main()
