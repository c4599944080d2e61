"""Cold start: from spawning a server process to the first token of a chat request behind a long system prompt.

    python -m benchmarks.cold_start [--models smollm2-135m qwen2.5-0.5b] [--rounds 3] [--json OUT]
    python -m benchmarks.cold_start --models smollm2-135m --loras 8 --systems warmstart   # LoRA adapters

The `cold-start` workload of ../shared/bench/workloads.json: a ~2,048-token system prompt, a 32-token user
message, one request on a process that has just started. Per model (random weights, bf16), alternating, a
fresh process each run:

- warmstart (cache): `warmstart serve` on a snapshot built with that system prompt (`--system`), its
  blobs already in the local cache;
- warmstart (S3 pull): the same from an empty cache, pulling from a moto S3 server on 127.0.0.1;
- transformers: benchmarks/hf_handler.py, the Starlette + `from_pretrained` + `generate` handler a user
  would write, which prefills the system prompt on every request;
- floor: a process that only imports what serving needs (torch, starlette, uvicorn, tokenizers).

With ``--loras N`` the same snapshot is built a second time with N random LoRA adapters (rank ``--lora-rank``,
every projection targeted) stored as their own blobs (`--lora NAME=DIR`), and each warmstart run is paired with
the same run on that snapshot, alternating within each round (which of the two goes first alternates from one
round to the next: the second finds the shared blobs in the page cache); the report adds each pair's difference (with
adapters minus without). ``--systems warmstart`` leaves out the transformers handler.

Each server is polled on /health every 10 ms; once it answers 200 the request is sent (max_tokens 1, so
the response marks the first token). Time is counted from just before the spawn. warmstart's own timeline
(/status) is printed beside it. The bars: 2.5x the transformers handler with SmolLM2-135M, 4x with
Qwen2.5-0.5B.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import harness
from benchmarks.throughput import model_dir as bench_model_dir
from benchmarks.workloads import REPO, SHARED_BENCH, text_of_tokens

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
            if response.status_code != 200:
                raise RuntimeError(f"{cmd[:5]}: {response.status_code} {response.text[:2000]}")
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


def random_lora(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory (as save_pretrained writes it) with random A and B on every projection of ``model``."""
    import torch
    from safetensors.torch import save_file

    from warmstart.runtime.models.config import ModelConfig

    c = ModelConfig.from_dir(model)
    shapes = {"self_attn.q_proj": (c.hidden_size, c.q_size), "self_attn.k_proj": (c.hidden_size, c.kv_size),
              "self_attn.v_proj": (c.hidden_size, c.kv_size), "self_attn.o_proj": (c.q_size, c.hidden_size),
              "mlp.gate_proj": (c.hidden_size, c.intermediate_size),
              "mlp.up_proj": (c.hidden_size, c.intermediate_size),
              "mlp.down_proj": (c.intermediate_size, c.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": sorted(m.split(".")[1] for m in shapes), "base_model_name_or_path": str(model)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def prepare(config: Path, workdir: Path, s3_endpoint: str, loras: int = 0,
            lora_rank: int = 16) -> tuple[Path, str, str, str | None]:
    """The model, its system prompt, and a snapshot with that prompt in a local store and in S3 (and the same with
    ``loras`` random LoRA adapters, when asked: its id last, else None)."""
    import boto3

    from warmstart.runtime.tokenizer import Tokenizer
    from warmstart.snapshot.adapters import AdapterSpec
    from warmstart.snapshot.build import BuildOptions, PrefixSpec, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.stores import open_store
    from warmstart.snapshot.transfer import push_snapshot

    model = bench_model_dir(config)
    system = text_of_tokens(Tokenizer(model), 2048)
    (workdir / "system.txt").write_text(system)
    spec = PrefixSpec("policy", workdir / "system.txt", "system")
    specs = [AdapterSpec(f"lora{i}", random_lora(model, workdir / f"lora{i}", lora_rank, i)) for i in range(loras)]
    os.environ.update(AWS_ENDPOINT_URL=s3_endpoint, **AWS)
    boto3.client("s3").create_bucket(Bucket="bench")
    ids = []
    for options in [BuildOptions(dtype="bfloat16", prefixes=[spec])] + (
            [BuildOptions(dtype="bfloat16", prefixes=[spec], loras=specs)] if specs else []):
        built = build_snapshot(model, options, BlobCache(workdir / "cache"))
        for store in (str(workdir / "store"), "s3://bench/snapshots"):
            push_snapshot(open_store(store), built.manifest.encode(), built.id, built.blob_paths)
        ids.append(built.id)
    return model, system, ids[0], ids[1] if specs else None


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"])
    ap.add_argument("--loras", type=int, default=0, help="also time a snapshot with this many LoRA adapters")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--systems", choices=("all", "warmstart"), default="all",
                    help="warmstart: leave out the transformers handler")
    ap.add_argument("--load-only", action="store_true",
                    help="with --loras: time only what the adapters could add, in this process (snapshot.load from "
                         "the cache and one request behind the system prompt), both snapshots alternating")
    args = harness.parse(ap)

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    warmstart = [sys.executable, "-m", "warmstart.handlers.cli", "serve"]
    report: dict = {"floor_s": [], "models": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                work = Path(tmp) / name
                work.mkdir()
                model, system, sid, lora_sid = prepare(SHARED_BENCH / "models" / f"{name}.json", work, endpoint,
                                                       args.loras, args.lora_rank)
                if args.load_only and lora_sid is not None:
                    load_only(work, system, sid, lora_sid, args.rounds, args.loras)
                    continue
                names = ["warmstart (cache)", "warmstart (S3 pull)"]
                if lora_sid is not None:  # each right after the same run without adapters
                    names = [n for base in names for n in (base, f"{base} + {args.loras} LoRA")]
                if args.systems == "all":
                    names.append("transformers")
                runs: dict[str, list[dict]] = {n: [] for n in names}
                for round_index in range(args.rounds):
                    report["floor_s"].append(floor_seconds())
                    order = list(runs)
                    if round_index % 2:  # each pair the other way round: the second of two starts finds the
                        order = [n for i in range(0, len(order), 2) for n in order[i:i + 2][::-1]]  # page cache warm
                    for system_name in order:
                        p = free_port()
                        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
                        ref = lora_sid if "LoRA" in system_name else sid
                        if system_name == "transformers":
                            cmd = [sys.executable, "-m", "uvicorn", "benchmarks.hf_handler:app", "--port", str(p),
                                   "--log-level", "warning"]
                            env["MODEL_DIR"] = str(model)
                        elif system_name.startswith("warmstart (cache)"):
                            cmd = [*warmstart, ref, "--store", str(work / "store"), "--cache", str(work / "cache"),
                                   "--port", str(p)]
                        else:
                            empty = work / "empty-cache"
                            shutil.rmtree(empty, ignore_errors=True)
                            cmd = [*warmstart, ref, "--store", "s3://bench/snapshots", "--cache", str(empty),
                                   "--port", str(p)]
                            env.update(AWS_ENDPOINT_URL=endpoint, **AWS)
                        runs[system_name].append(first_token(cmd, env, p, system))
                report["models"][name] = runs
    finally:
        server.stop()
    if not args.load_only:
        harness.report(args, print_report(report))


def load_only(work: Path, system: str, sid: str, lora_sid: str, rounds: int, loras: int) -> None:
    """In this process: load each snapshot from the cache and serve one chat request behind its system prompt,
    alternating (which goes first alternates too); prints per-round differences, with adapters minus without."""
    from warmstart.runtime import SamplingParams
    from warmstart.snapshot.loader import load

    params = SamplingParams(max_tokens=1, temperature=0)
    times: dict[str, list[tuple[float, float]]] = {sid: [], lora_sid: []}
    for r in range(rounds):
        for ref in (sid, lora_sid) if r % 2 == 0 else (lora_sid, sid):
            start = time.perf_counter()
            llm = load(ref, store=str(work / "store"), cache=work / "cache")
            loaded = time.perf_counter() - start
            messages = [{"role": "system", "content": system}, {"role": "user", "content": USER}]
            out = llm.generate([llm.engine.tokenizer.encode_chat(messages)], params)[0]
            times[ref].append((loaded, time.perf_counter() - start))
            assert out.cached_tokens > 0, "the system prompt's KV was not used"
            del llm
    for i, what in enumerate(("load", "load + first request")):
        deltas = [round(b[i] - a[i], 4) for a, b in zip(times[sid], times[lora_sid], strict=True)]
        base = harness.median(t[i] for t in times[sid])
        print(f"{what}: without adapters {base:.4f} s (median); with {loras} LoRA minus without, per round: {deltas} s "
              f"(median {harness.median(deltas):+.4f} s)")


def print_report(report: dict) -> dict:
    floor = harness.median(report["floor_s"])
    summary: dict = {"floor_s": floor, "models": {}}
    for name, runs in report["models"].items():
        rows = {}
        for system, results in runs.items():
            rows[system] = {"ready_s": harness.median(r["ready_s"] for r in results),
                            "first_token_s": harness.median(r["first_token_s"] for r in results),
                            "usage": results[-1]["usage"], "timeline": results[-1].get("timeline")}
        if "transformers" in rows:
            hf = rows["transformers"]["first_token_s"]
            for row in rows.values():
                row["speedup_vs_transformers"] = hf / row["first_token_s"]
        for system, results in runs.items():
            if "LoRA" in system:  # paired with the run just before it in each round, on the same snapshot less them
                base = runs[system.split(" + ")[0]]
                for key in ("ready_s", "first_token_s"):
                    deltas = [round(r[key] - b[key], 4) for r, b in zip(results, base, strict=True)]
                    rows[system][f"pairs_{key}_delta"] = deltas
                    rows[system][f"median_{key}_delta"] = harness.median(deltas)
        summary["models"][name] = rows
    print(f"import-only floor ({FLOOR}): {floor:.3f} s (median)")
    for name, rows in summary["models"].items():
        print(f"\n{name} (bf16, random weights), ~2,048-token system prompt, first token after spawn; medians")
        print(f"{'system':<34}{'ready s':>9}{'1st token s':>13}{'vs floor':>10}{'speedup':>9}  cached/prompt")
        for system, r in rows.items():
            usage = r["usage"] or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            speedup = f"{r['speedup_vs_transformers']:>8.1f}x" if "speedup_vs_transformers" in r else f"{'-':>9}"
            print(f"{system:<34}{r['ready_s']:>9.3f}{r['first_token_s']:>13.3f}{r['first_token_s'] - floor:>+10.3f}"
                  f"{speedup}  {cached}/{usage.get('prompt_tokens', '?')}")
            for key in ("ready_s", "first_token_s"):
                if f"pairs_{key}_delta" in r:
                    print(f"{'':<34}{key[:-2]}, with adapters minus without, per round: {r[f'pairs_{key}_delta']} s "
                          f"(median {r[f'median_{key}_delta']:+.4f} s)")
        timeline = rows["warmstart (cache)"]["timeline"]
        if timeline:
            print("warmstart (cache) timeline, last run: " + json.dumps(timeline))
    return summary


if __name__ == "__main__":
    main()
