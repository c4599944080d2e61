"""Cold start: from spawning a server process to the first token of a chat request behind a long system prompt.

    python benchmarks/cold_start.py [--models smollm2-135m qwen2.5-0.5b] [--rounds 3] [--json]

The `cold-start` workload of ../shared/bench/workloads.json: a ~2,048-token system prompt, a 32-token user
message, one request on a process that has just started. Per model (random weights, bf16), alternating, a
fresh process each run:

- warmstart (cache): `warmstart serve` on a snapshot built with that system prompt (`--system`), its
  blobs already in the local cache;
- warmstart (S3 pull): the same from an empty cache, pulling from a moto S3 server on 127.0.0.1;
- transformers: benchmarks/hf_handler.py, the Starlette + `from_pretrained` + `generate` handler a user
  would write, which prefills the system prompt on every request;
- floor: a process that only imports what serving needs (torch, starlette, uvicorn, tokenizers).

Each server is polled on /health every 10 ms; once it answers 200 the request is sent (max_tokens 1, so
the response marks the first token). Time is counted from just before the spawn. warmstart's own timeline
(/status) is printed beside it. The bars (issue 4): 2.5x the transformers handler with SmolLM2-135M, 4x with
Qwen2.5-0.5B.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import model_dir as bench_model_dir  # noqa: E402
from benchmarks.workloads import REPO, SHARED_BENCH, text_of_tokens  # noqa: E402

USER = "Summarise the policy above for a new colleague in one short paragraph, please, thanks."
FLOOR = "import torch, starlette, uvicorn, tokenizers"
AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_token(cmd: list[str], env: dict[str, str], port: int, system: str, timeout: float = 300) -> dict:
    """Spawn, wait for /health 200, send the chat request; seconds from spawn to each point."""
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    try:
        with httpx.Client(timeout=timeout) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}: {proc.stderr.read()[-2000:]!r}")
                try:
                    if client.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.perf_counter() - start > timeout:
                    raise RuntimeError(f"{cmd[:4]} not ready after {timeout} s")
                time.sleep(0.01)
            ready = time.perf_counter() - start
            body = {"max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": USER}]}
            response = client.post(f"{base}/v1/chat/completions", json=body)
            response.raise_for_status()
            done = time.perf_counter() - start
            result = {"ready_s": ready, "first_token_s": done, "usage": response.json().get("usage")}
            status = client.get(f"{base}/status")
            if status.status_code == 200:
                result["timeline"] = status.json().get("phases")
            return result
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (the server drains and exits), then SIGKILL if it has not gone within ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def floor_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR], check=True)
    return time.perf_counter() - start


def prepare(config: Path, workdir: Path, s3_endpoint: str) -> tuple[Path, str, str]:
    """The model, its system prompt, and a snapshot with that prompt in a local store and in S3."""
    import boto3

    from runtime.tokenizer import Tokenizer
    from snapshot.build import BuildOptions, PrefixSpec, build_snapshot
    from snapshot.cache import BlobCache
    from snapshot.stores import open_store
    from snapshot.transfer import push_snapshot

    model = bench_model_dir(config)
    system = text_of_tokens(Tokenizer(model), 2048)
    (workdir / "system.txt").write_text(system)
    spec = PrefixSpec("policy", workdir / "system.txt", "system")
    built = build_snapshot(model, BuildOptions(dtype="bfloat16", prefixes=[spec]), BlobCache(workdir / "cache"))
    push_snapshot(open_store(str(workdir / "store")), built.manifest.encode(), built.id, built.blob_paths)
    os.environ.update(AWS_ENDPOINT_URL=s3_endpoint, **AWS)
    boto3.client("s3").create_bucket(Bucket="bench")
    push_snapshot(open_store("s3://bench/snapshots"), built.manifest.encode(), built.id, built.blob_paths)
    return model, system, built.id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    warmstart = [sys.executable, "-m", "handlers.cli", "serve"]
    report: dict = {"floor_s": [], "models": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                work = Path(tmp) / name
                work.mkdir()
                model, system, sid = prepare(SHARED_BENCH / "models" / f"{name}.json", work, endpoint)
                runs: dict[str, list[dict]] = {"warmstart (cache)": [], "warmstart (S3 pull)": [], "transformers": []}
                for _ in range(args.rounds):
                    report["floor_s"].append(floor_seconds())
                    for system_name in runs:
                        p = free_port()
                        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
                        if system_name == "transformers":
                            cmd = [sys.executable, "-m", "uvicorn", "benchmarks.hf_handler:app", "--port", str(p),
                                   "--log-level", "warning"]
                            env["MODEL_DIR"] = str(model)
                        elif system_name == "warmstart (cache)":
                            cmd = [*warmstart, sid, "--store", str(work / "store"), "--cache", str(work / "cache"),
                                   "--port", str(p)]
                        else:
                            empty = work / "empty-cache"
                            shutil.rmtree(empty, ignore_errors=True)
                            cmd = [*warmstart, sid, "--store", "s3://bench/snapshots", "--cache", str(empty),
                                   "--port", str(p)]
                            env.update(AWS_ENDPOINT_URL=endpoint, **AWS)
                        runs[system_name].append(first_token(cmd, env, p, system))
                report["models"][name] = runs
    finally:
        server.stop()
    print_report(report, args.json)


def print_report(report: dict, as_json: bool) -> None:
    floor = statistics.median(report["floor_s"])
    summary: dict = {"floor_s": floor, "models": {}}
    for name, runs in report["models"].items():
        rows = {}
        for system, results in runs.items():
            rows[system] = {"ready_s": statistics.median(r["ready_s"] for r in results),
                            "first_token_s": statistics.median(r["first_token_s"] for r in results),
                            "usage": results[-1]["usage"], "timeline": results[-1].get("timeline")}
        hf = rows["transformers"]["first_token_s"]
        for row in rows.values():
            row["speedup_vs_transformers"] = hf / row["first_token_s"]
        summary["models"][name] = rows
    if as_json:
        print(json.dumps(summary))
        return
    print(f"import-only floor ({FLOOR}): {floor:.3f} s (median)")
    for name, rows in summary["models"].items():
        print(f"\n{name} (bf16, random weights), ~2,048-token system prompt, first token after spawn; medians")
        print(f"{'system':<22}{'ready s':>9}{'1st token s':>13}{'vs floor':>10}{'speedup':>9}  cached/prompt")
        for system, r in rows.items():
            usage = r["usage"] or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            print(f"{system:<22}{r['ready_s']:>9.3f}{r['first_token_s']:>13.3f}{r['first_token_s'] - floor:>+10.3f}"
                  f"{r['speedup_vs_transformers']:>8.1f}x  {cached}/{usage.get('prompt_tokens', '?')}")
        timeline = rows["warmstart (cache)"]["timeline"]
        if timeline:
            print("warmstart (cache) timeline, last run: " + json.dumps(timeline))


if __name__ == "__main__":
    main()
