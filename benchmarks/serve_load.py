"""Serving under load: concurrent streaming clients over loopback on the `mixed` workload, with cost.

    python -m benchmarks.serve_load [--scale 0.25] [--concurrency 32] [--price-per-hour 1.0] [--json OUT]

Starts each server as a fresh process on 127.0.0.1 (the SmolLM2-135M shape, random weights, bf16), times
its cold start (spawn to /health 200), then replays the `mixed` workload's requests on their arrival
schedule through at most --concurrency clients at once: token-id prompts, greedy, EOS ignored, so exactly
max_tokens come back.

- warmstart: `warmstart serve` on a snapshot of the model (from the local cache), streaming
  (/v1/completions, stream=true): TTFT is the first token's chunk, inter-token latency the gaps after it.
- transformers: benchmarks/hf_handler.py, the handler a user would write without an engine: it cannot
  stream and runs one `generate` at a time, so its TTFT is the whole response.

Reported: tokens/s ((prompt + generated) / wall), generated tokens/s, TTFT and inter-token latency p50/p99,
errors (must be 0), cold start, and with --price-per-hour the cost per million tokens for an instance that
starts cold, serves this workload and stops: price x (cold start + wall) / tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.cold_start import free_port, stop
from benchmarks.throughput import model_dir as bench_model_dir
from benchmarks.throughput import pct
from benchmarks.workloads import REPO, SHARED_BENCH, Request, load_workload


async def one_request(client: httpx.AsyncClient, r: Request, stream: bool, t0: float) -> dict:
    body = {"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    sent = time.perf_counter()
    stamps: list[float] = []
    try:
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return {"error": f"{response.status_code} {(await response.aread())[:200]!r}"}
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            stamps.append(time.perf_counter())
        else:
            response = await client.post("/v1/completions", json=body)
            if response.status_code != 200:
                return {"error": f"{response.status_code} {response.text[:200]!r}"}
            stamps.append(time.perf_counter())
    except httpx.HTTPError as e:
        return {"error": repr(e)}
    return {"ttft": stamps[0] - sent, "gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "end": stamps[-1] - t0}


async def replay(base: str, requests: list[Request], concurrency: int, stream: bool) -> tuple[list[dict], float]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=3600) as client:
        t0 = time.perf_counter()

        async def scheduled(r: Request) -> dict:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
            async with limit:
                return await one_request(client, r, stream, t0)

        results = await asyncio.gather(*(scheduled(r) for r in requests))
        return list(results), time.perf_counter() - t0


def run_server(cmd: list[str], env: dict[str, str], port: int, requests: list[Request], concurrency: int,
               stream: bool, cwd: Path = REPO) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]!r}")
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        cold_start = time.perf_counter() - start
        results, wall = asyncio.run(replay(base, requests, concurrency, stream))
    finally:
        stop(proc)
    ok = [r for r in results if "error" not in r]
    gaps = [g for r in ok for g in r["gaps"]]
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    generated = sum(r.max_tokens for r in requests)
    return {"cold_start_s": cold_start, "wall_s": wall, "errors": len(results) - len(ok),
            "first_errors": [r["error"] for r in results if "error" in r][:3],
            "tok_s": (prompt + generated) / wall, "gen_tok_s": generated / wall,
            "ttft_p50": pct([r["ttft"] for r in ok], 0.5), "ttft_p99": pct([r["ttft"] for r in ok], 0.99),
            "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99), "tokens": prompt + generated}


def main() -> None:
    ap = harness.arguments(__doc__, rounds=None)
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--scale", type=float, default=0.25, help="fraction of the mixed workload's 128 requests")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--systems", nargs="+", default=["warmstart", "transformers"])
    ap.add_argument("--price-per-hour", type=float, help="instance price, for the cost per million tokens")
    args = harness.parse(ap)

    from warmstart.snapshot.build import BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.stores import open_store
    from warmstart.snapshot.transfer import push_snapshot

    model = bench_model_dir(args.config)
    requests = load_workload("mixed", json.loads((model / "config.json").read_text())["vocab_size"], scale=args.scale)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        built = build_snapshot(model, BuildOptions(dtype="bfloat16"), BlobCache(Path(tmp) / "cache"))
        push_snapshot(open_store(str(Path(tmp) / "store")), built.manifest.encode(), built.id, built.blob_paths)
        for system in args.systems:
            port = free_port()
            if system == "warmstart":
                cmd = [sys.executable, "-m", "warmstart.handlers.cli", "serve", built.id, "--store",
                       str(Path(tmp) / "store"), "--cache", str(Path(tmp) / "cache"), "--port", str(port),
                       "--max-queue", "1024"]
                rows[system] = run_server(cmd, env, port, requests, args.concurrency, stream=True)
            else:
                cmd = [sys.executable, "-m", "uvicorn", "benchmarks.hf_handler:app", "--port", str(port),
                       "--log-level", "warning"]
                rows[system] = run_server(cmd, {**env, "MODEL_DIR": str(model)}, port, requests,
                                          args.concurrency, stream=False)
            if args.price_per_hour:
                r = rows[system]
                r["usd_per_million_tokens"] = args.price_per_hour * (r["cold_start_s"] + r["wall_s"]) / 3600 / (
                    r["tokens"] / 1e6)
    print(f"mixed x {args.scale}: {len(requests)} requests, {rows[args.systems[0]]['tokens']} tokens, "
          f"at most {args.concurrency} clients at once; {args.config.stem} bf16")
    print(f"{'system':<14}{'tok/s':>7}{'gen tok/s':>10}{'TTFT p50':>9}{'p99':>7}{'ITL p50':>8}{'p99':>7}"
          f"{'errors':>7}{'cold s':>7}{'$/Mtok':>8}{'ratio':>7}")
    ours = rows.get("warmstart", {}).get("tok_s")
    for system, r in rows.items():
        cost = f"{r['usd_per_million_tokens']:.3f}" if "usd_per_million_tokens" in r else "-"
        ratio = f"{ours / r['tok_s']:.2f}x" if ours else "-"
        print(f"{system:<14}{r['tok_s']:>7.0f}{r['gen_tok_s']:>10.0f}{r['ttft_p50']:>9.2f}{r['ttft_p99']:>7.2f}"
              f"{r['itl_p50']:>8.3f}{r['itl_p99']:>7.3f}{r['errors']:>7}{r['cold_start_s']:>7.2f}{cost:>8}{ratio:>7}")
        if r["errors"]:
            print(f"  first errors: {r['first_errors']}")
    harness.report(args, {"requests": len(requests), "concurrency": args.concurrency, "rows": rows})


if __name__ == "__main__":
    main()
