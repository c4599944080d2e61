"""gpu_check's `served` section: `warmstart serve --device DEVICE` as a real process on random models of real shapes.

Per model (SmolLM2-135M and Llama-3.2-1B shapes in bf16 on a GPU; the tiny llama family in float32 in the dry run):

1. a snapshot built into a local directory store;
2. cold start, twice, each a fresh `warmstart serve` process polled on /health every 10 ms, then one request
   (32 prompt tokens, max_tokens 1) for the first token; times from just before the spawn. First with an empty
   blob cache and an empty Triton cache (blobs pulled from the store, kernels compiled), then over the blob
   cache and the Triton cache the first filled (what an instance with a warm volume and a carried kernel cache
   does). The server's own timeline (/status: phases and their details, the device and ops it serves on) is
   kept, and its `device_copy` rate is set against the host-to-device bandwidth measured by the
   host_to_device section (pinned memory, one copy);
3. greedy tokens of that second server (/v1/completions with token-id prompts, temperature 0, logprobs 0 for
   the tokens) against transformers' `generate` on the same device and dtype, in this process. Random models
   have near-ties, so a first difference where the reference's top-2 logits are within rounding (1e-3 in
   float32; 1/64 of the top logit, about two bf16 steps, in bf16) is reported as such, not as a mismatch;
4. served load: the same requests (token-id prompts, greedy, EOS ignored, all sent at once) to that server,
   streaming (TTFT is the first token's chunk), and to benchmarks/hf_handler.py (Starlette + transformers
   `generate`, one request at a time, no streaming: its TTFT is the whole response) on the same device and
   dtype; tokens/s = (prompt + generated) / wall, side by side with the ratio.

Every step checks the run's deadline first and says when it skipped for lack of time.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.cold_start import free_port, stop
from benchmarks.serve_load import replay
from benchmarks.throughput import pct
from benchmarks.workloads import Request

ROOT = Path(__file__).resolve().parent.parent
SERVED_MODELS = ("smollm2-135m", "llama-3.2-1b")
FIRST_PROMPT_TOKENS = 32
GPU_MEMORY_UTILIZATION = "0.6"  # leaves room on the GPU for transformers beside the server


@dataclass(frozen=True)
class Sizes:
    greedy_prompt_lens: tuple[int, ...]
    greedy_tokens: int
    requests: int
    prompt_tokens: int
    max_tokens: int
    start_timeout_s: float


DRY = Sizes(greedy_prompt_lens=(5, 23), greedy_tokens=4, requests=4, prompt_tokens=12, max_tokens=4,
            start_timeout_s=120)
GPU = Sizes(greedy_prompt_lens=(7, 60, 200, 400), greedy_tokens=24, requests=16, prompt_tokens=256, max_tokens=64,
            start_timeout_s=240)


def left(deadline: float) -> float:
    return deadline - time.monotonic()


# -- a server process -----------------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base: str
    spawned: float
    log: Path

    def failure(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def spawn(cmd: list[str], env: dict[str, str], port: int, log: Path) -> Server:
    out = log.open("wb")
    spawned = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    out.close()
    return Server(proc, f"http://127.0.0.1:{port}", spawned, log)


def wait_ready(server: Server, timeout: float) -> float:
    """Seconds from the spawn to /health answering 200."""
    with httpx.Client(timeout=5) as client:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.failure()}")
            try:
                if client.get(f"{server.base}/health").status_code == 200:
                    return time.perf_counter() - server.spawned
            except httpx.TransportError:
                pass
            if time.perf_counter() - server.spawned > timeout:
                raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{server.failure()}")
            time.sleep(0.01)


def first_token(server: Server, prompt: list[int]) -> float:
    """Seconds from the spawn to the reply of a one-token request."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return time.perf_counter() - server.spawned


def timeline(server: Server) -> dict[str, Any]:
    """What /status says about the start: phases, their details, and the device and ops the engine runs on."""
    status = httpx.get(f"{server.base}/status", timeout=30).json()
    keep = ("phases", "details", "device", "ops", "device_copy", "engine", "pull")
    return {k: status[k] for k in keep if k in status}


def device_copy_rate(status: dict[str, Any]) -> float | None:
    """The device copy's GB/s from the server's timeline details (None where the phase did not happen)."""
    details = status.get("details", {}).get("device_copy")
    if not details:
        return None
    if details.get("gb_per_s"):
        return float(details["gb_per_s"])
    if details.get("bytes") and details.get("seconds"):
        return float(details["bytes"]) / float(details["seconds"]) / 1e9
    return None


# -- one model ------------------------------------------------------------------------------------------------


def build(model_dir: Path, dtype: str, work: Path) -> tuple[str, Path, float]:
    """A snapshot of ``model_dir`` in a local directory store: (id, store, seconds)."""
    from warmstart.snapshot.build import BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.stores import open_store
    from warmstart.snapshot.transfer import push_snapshot

    start = time.perf_counter()
    built = build_snapshot(model_dir, BuildOptions(dtype=dtype), BlobCache(work / "build-cache"))
    store = work / "store"
    push_snapshot(open_store(str(store)), built.manifest.encode(), built.id, built.blob_paths, progress=False)
    shutil.rmtree(work / "build-cache", ignore_errors=True)  # the servers pull from the store
    return built.id, store, time.perf_counter() - start


def start_timeout(sizes: Sizes, deadline: float) -> float:
    return min(sizes.start_timeout_s, max(30.0, left(deadline)))


def cold_start(cmd: list[str], env: dict[str, str], log: Path, prompt: list[int], sizes: Sizes, deadline: float,
               keep: bool) -> tuple[dict[str, Any], Server | None]:
    """Spawn, ready, first token, timeline; the server is stopped unless ``keep``."""
    port = free_port()
    server = spawn([*cmd, "--port", str(port)], env, port, log)
    try:
        ready = wait_ready(server, start_timeout(sizes, deadline))
        first = first_token(server, prompt)
        result = {"ready_s": ready, "first_token_s": first, "status": timeline(server)}
    except BaseException:
        stop(server.proc)
        raise
    if not keep:
        stop(server.proc)
        return result, None
    return result, server


def served_tokens(base: str, prompt: list[int], max_tokens: int) -> list[str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return list(response.json()["choices"][0]["logprobs"]["tokens"])


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token as the server's logprobs name it (handlers.openai.requests.ServedModel.token_text)."""
    try:
        return str(tokenizer.decode([token_id], skip_special_tokens=False))
    except Exception:  # an id past the tokenizer's vocabulary (the model's may be larger)
        return f"token_id:{token_id}"


def greedy_vs_transformers(base: str, model_dir: Path, dtype: str, device: torch.device,
                           prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from warmstart.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    rows = []
    try:
        for prompt in prompts:
            ours = served_tokens(base, prompt, max_tokens)
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            ref_ids = out[0, len(prompt):].tolist()
            ref = [token_text(tokenizer, t) for t in ref_ids]
            rows.append(compare(model, device, dtype, prompt, ref_ids, ours, ref))
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # In bfloat16 two implementations of a random-weight model part within a few tokens (on an H200 both ours and
    # transformers' logits drift 2-5 from float32 at 60-400 tokens): counted here, judged by gpu_check's bf16_drift.
    exact = dtype == "float32"
    return {"prompts": len(rows), "identical": sum(r["identical"] for r in rows),
            "matches": all(r["identical"] or r["near_tie"] for r in rows) if exact else None, "rows": rows}


def compare(model: Any, device: torch.device, dtype: str, prompt: list[int], ref_ids: list[int], ours: list[str],
            ref: list[str]) -> dict[str, Any]:
    """One prompt: where our tokens first differ from the reference's, and whether the reference was near a tie
    there."""
    row: dict[str, Any] = {"prompt_tokens": len(prompt), "tokens": len(ref), "identical": ours == ref}
    if ours == ref:
        return row
    at = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    row["first_difference"] = at
    if at >= len(ref) or len(ours) != len(ref):
        row.update(near_tie=False, why=f"{len(ours)} tokens served, {len(ref)} expected")
        return row
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref_ids[:at]], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    gap, scale = float(top[0] - top[1]), float(top[0].abs())
    tolerance = 1e-3 if dtype == "float32" else max(scale, 1.0) / 64
    row.update(ours=ours[at], reference=ref[at], top2_gap=gap, tolerance=tolerance, near_tie=gap <= tolerance)
    return row


def load(base: str, requests: list[Request], stream: bool, timeout: float) -> dict[str, Any]:
    """All ``requests`` at once; a server that has not answered them all within ``timeout`` s is an error."""
    results, wall = asyncio.run(asyncio.wait_for(replay(base, requests, len(requests), stream), timeout))
    ok = [r for r in results if "error" not in r]
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    generated = sum(r.max_tokens for r in requests)
    ttft = [r["ttft"] for r in ok]
    return {"wall_s": wall, "errors": len(results) - len(ok), "first_errors": [r["error"] for r in results
                                                                             if "error" in r][:3],
            "tok_s": (prompt + generated) / wall, "gen_tok_s": generated / wall,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99)}


def transformers_served(model_dir: Path, dtype: str, device: torch.device, env: dict[str, str], work: Path,
                        prompt: list[int], requests: list[Request], sizes: Sizes, deadline: float) -> dict[str, Any]:
    """benchmarks/hf_handler.py on the same device: its cold start (ready, first token) and the same load."""
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "benchmarks.hf_handler:app", "--port", str(port), "--log-level",
           "warning"]
    handler_env = {**env, "MODEL_DIR": str(model_dir), "DEVICE": str(device), "DTYPE": dtype}
    server = spawn(cmd, handler_env, port, work / "transformers.log")
    try:
        ready = wait_ready(server, start_timeout(sizes, deadline))
        first = first_token(server, prompt)
        return {"ready_s": ready, "first_token_s": first,
                **load(server.base, requests, stream=False, timeout=max(10.0, left(deadline)))}
    finally:
        stop(server.proc)


def served_model(name: str, model_dir: Path, dry: bool, device: torch.device, env: dict[str, str],
                 deadline: float, host_to_device: dict[str, Any], out: dict[str, Any]) -> None:
    """Fills ``out`` step by step, so what was measured before a failure is kept."""
    sizes = DRY if dry else GPU
    dtype = "float32" if dry else "bfloat16"
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(16, vocab - 16) for _ in range(n)]

    out["dtype"] = dtype
    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-"))
    try:
        sid, store, out["snapshot_build_s"] = build(model_dir, dtype, work)
        # Compiled kernels go where the product puts them (under the snapshot cache, or warmstart's own directory
        # under XDG_CACHE_HOME), both fresh here: the first server compiles, the second finds them.
        serve_env = {k: v for k, v in env.items() if k != "TRITON_CACHE_DIR"} | {"XDG_CACHE_HOME": str(work / "xdg")}
        cmd = [sys.executable, "-m", "warmstart.handlers.cli", "serve", sid, "--store", str(store), "--cache",
               str(work / "cache"), "--device", device.type, "--max-queue", "1024"]
        if device.type == "cuda":
            cmd += ["--gpu-memory-utilization", GPU_MEMORY_UTILIZATION]
        first_prompt = tokens(FIRST_PROMPT_TOKENS)
        cold: dict[str, Any] = {}
        out["cold_start"] = cold
        cold["empty_caches"], _ = cold_start(cmd, serve_env, work / "serve-1.log", first_prompt, sizes, deadline,
                                             keep=False)
        if left(deadline) < 30:
            out["skipped"] = "past the time budget after the first cold start"
            return
        cold["warm_caches"], server = cold_start(cmd, serve_env, work / "serve-2.log", first_prompt, sizes,
                                                 deadline, keep=True)
        assert server is not None
        try:
            out["device_copy_vs_bus"] = copy_vs_bus(cold, host_to_device)
            prompts = [tokens(n) for n in sizes.greedy_prompt_lens]
            out["greedy"] = greedy_vs_transformers(server.base, model_dir, dtype, device, prompts,
                                                   sizes.greedy_tokens)
            requests = [Request(tokens(sizes.prompt_tokens), sizes.max_tokens, 0.0) for _ in range(sizes.requests)]
            out["load"] = {"requests": sizes.requests, "prompt_tokens": sizes.prompt_tokens,
                           "max_tokens": sizes.max_tokens,
                           "warmstart": load(server.base, requests, stream=True, timeout=max(10.0, left(deadline)))}
        finally:
            stop(server.proc)
        if left(deadline) < 20:
            out["load"]["transformers"] = {"skipped": "past the time budget"}
            return
        hf = transformers_served(model_dir, dtype, device, env, work, first_prompt, requests, sizes, deadline)
        ours = out["load"]["warmstart"]
        out["load"].update(transformers=hf, tok_s_ratio=ours["tok_s"] / hf["tok_s"],
                           ttft_p50_ratio=hf["ttft_p50_s"] / ours["ttft_p50_s"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def copy_vs_bus(cold: dict[str, Any], host_to_device: dict[str, Any]) -> dict[str, Any]:
    bus = host_to_device.get("pinned_gb_s")
    rows: dict[str, Any] = {"pinned_h2d_gb_s": bus}
    for label, run in cold.items():
        rate = device_copy_rate(run["status"])
        rows[label] = {"device_copy_gb_s": rate, "of_pinned_h2d": rate / bus if rate and bus else None}
    return rows


def served(dry: bool, device: torch.device, deadline: float, env: dict[str, str], model_dirs: dict[str, Path],
           host_to_device: dict[str, Any]) -> dict[str, Any]:
    """Every model in ``model_dirs``, one after the other; one failing is recorded and the next runs."""
    import traceback

    results: dict[str, Any] = {}
    for name, model_dir in model_dirs.items():
        if left(deadline) < 60:
            results[name] = {"skipped": f"past the time budget ({max(0.0, left(deadline)):.0f} s left)"}
            continue
        start = time.monotonic()
        out: dict[str, Any] = {}
        results[name] = out
        try:
            served_model(name, model_dir, dry, device, env, deadline, host_to_device, out)
        except Exception as e:  # the next model's figures still count
            out.update(error=f"{type(e).__name__}: {e}"[:4000], traceback=traceback.format_exc()[-3000:])
        out["seconds"] = time.monotonic() - start
        print(summary_line(name, results[name]), flush=True)
    return results


def summary_line(name: str, r: dict[str, Any]) -> str:
    if "dtype" not in r:
        return f"[gpu_check] served {name}: {r.get('error') or r.get('skipped')}"
    lines = [f"[gpu_check] served {name} ({r['dtype']}):"]
    for label, run in r.get("cold_start", {}).items():
        lines.append(f"  cold start, {label}: ready {run['ready_s']:.2f} s, first token {run['first_token_s']:.2f} s")
        status = run["status"]
        lines.append("    timeline (s since start): " + ", ".join(f"{k} {v:.2f}" for k, v in status["phases"].items()))
        for phase in ("device_copy", "kernels", "graphs"):
            if phase in status.get("details", {}):
                lines.append(f"    {phase}: {json.dumps(status['details'][phase])[:300]}")
    bus = r.get("device_copy_vs_bus", {})
    for label, row in bus.items():
        if isinstance(row, dict) and row.get("device_copy_gb_s"):
            lines.append(f"  device_copy ({label}): {row['device_copy_gb_s']:.1f} GB/s against pinned "
                         f"host-to-device {bus['pinned_h2d_gb_s']:.1f} GB/s")
    if "greedy" in r:
        g = r["greedy"]
        lines.append(f"  greedy vs transformers: {g['identical']}/{g['prompts']} identical, matches={g['matches']}")
    load_ = r.get("load", {})
    for system in ("warmstart", "transformers"):
        row = load_.get(system, {})
        if "tok_s" in row:
            lines.append(f"  {system:<13} {row['tok_s']:>9.0f} tok/s  TTFT p50 {row['ttft_p50_s']:.3f} s  "
                         f"p99 {row['ttft_p99_s']:.3f} s  errors {row['errors']}")
    if "tok_s_ratio" in load_:
        lines.append(f"  ratio         {load_['tok_s_ratio']:>8.2f}x tok/s, TTFT p50 {load_['ttft_p50_ratio']:.1f}x "
                     "lower")
    for key in ("skipped", "error"):
        if key in r:
            lines.append(f"  {key}: {r[key]}")
    return "\n".join(lines)
