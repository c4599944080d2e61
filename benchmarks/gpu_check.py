"""Everything the CUDA path needs checked on a GPU, in one run of under 8 minutes on one H200.

    python benchmarks/gpu_check.py [--out benchmarks/results] [--budget-s 450]
    python benchmarks/gpu_check.py --dry-run     # on the CPU: every section at toy size (a test runs this)

Sections, in order; each is timed, a failing one is recorded and the next runs; a section that would start
past the budget is skipped (and says so):
1. kernels: the `kernels` tests, compiled (not interpreted).
2. engine_vs_transformers: every tiny model family on CUDA (Triton kernels, decode CUDA graphs) against
   transformers' greedy tokens in float32.
3. first_call: each kernel's first call (compile) and second call at SmolLM2-135M's shapes, with an empty
   Triton cache and again in a fresh process over the cache the first filled (what an image carries).
4. throughput: ours (bf16, CUDA, kernels + graphs) and transformers (bf16, CUDA, one static batch) on the
   SmolLM2-135M, Qwen2.5-0.5B and Llama-3.2-1B shapes with random weights, side by side, and the ratio.
5. host_to_device: snapshot.device_copy's staged copy of 1 GiB against a plain `.to("cuda")`.
6. cold_start: benchmarks/cold_start.py from local disk (one round, SmolLM2-135M).
Writes gpu_check.json and gpu_check.md under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # the dry run proves the wiring under Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import SHARED_BENCH  # noqa: E402
from runtime.engine.cuda_graphs import DEFAULT_BATCH_SIZES  # noqa: E402
from runtime.engine.engine import EngineOptions, LLMEngine  # noqa: E402
from runtime.engine.model_runner import GRAPHS_ENV  # noqa: E402
from runtime.models.config import ModelConfig  # noqa: E402
from runtime.models.weights import ModelWeights, load_weights  # noqa: E402
from runtime.random_model import make_random_model  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402

BENCH_MODELS = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b")


def weights_to(weights: ModelWeights, device: torch.device) -> ModelWeights:
    """Float weights moved to ``device`` (quantized ones are not part of this check)."""

    def move(obj: Any) -> Any:
        return obj.to(device) if isinstance(obj, torch.Tensor) else obj

    layers = [dataclasses.replace(layer, **{k: move(v) for k, v in vars(layer).items()}) for layer in weights.layers]
    embed = weights.embed.to(device)
    lm_head = embed if weights.lm_head is weights.embed else move(weights.lm_head)
    return ModelWeights(embed=embed, layers=layers, norm=weights.norm.to(device), lm_head=lm_head)


def engine_on(
    model_dir: Path, dtype: str, device: torch.device, graph_sizes: tuple[int, ...], **options: Any
) -> tuple[LLMEngine, float]:
    """The engine on ``device`` with decode graphs captured at ``graph_sizes`` (on CUDA), and the capture's seconds."""
    config = ModelConfig.from_dir(model_dir)
    opts = EngineOptions(dtype=dtype, prepack_weights=False, **options)
    weights = load_weights(model_dir, config, getattr(torch, dtype))
    os.environ[GRAPHS_ENV] = "0"  # the runner would capture every default size; this check picks its own
    engine = LLMEngine.from_weights(config, weights_to(weights, device), None, opts)
    start = time.perf_counter()
    if device.type == "cuda":
        engine.runner.capture_decode_graphs(graph_sizes)
    return engine, time.perf_counter() - start


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


# -- sections -------------------------------------------------------------------------------------------------


def kernels_tests(dry: bool) -> dict:
    if dry:
        return {"skipped": "the dry run leaves the kernels tests to the normal test command"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "kernels", "-p", "no:cacheprovider",
           "tests/runtime/test_kernels.py", "tests/runtime/test_kernels_attention.py",
           "tests/runtime/test_kernels_quant.py"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    tail = done.stdout.strip().splitlines()[-15:]
    return {"passed": done.returncode == 0, "summary": tail[-1] if tail else "", "tail": tail}


def engine_vs_transformers(dry: bool, device: torch.device) -> dict:
    from tests.support.model_configs import FAMILIES
    from tests.support.reference import assert_matches_reference

    families = ["llama3"] if dry else sorted(FAMILIES)
    max_tokens = 3 if dry else 8
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            model_dir = make_random_model(Path(tmp) / family, FAMILIES[family], seed=0, dtype="float32")
            vocab = FAMILIES[family]["vocab_size"]
            prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in ((5, 30) if dry else (3, 17, 40, 77, 130))]
            try:
                engine, _ = engine_on(model_dir, "float32", device, (1, 2, 4, 8), block_size=16, num_kv_blocks=128)
                outs = generate(engine, prompts, max_tokens)
                for prompt, out in zip(prompts, outs, strict=True):
                    assert_matches_reference(model_dir, prompt, out, max_tokens)
                graphs = engine.runner.graphs
                results[family] = {"matches": True, "ops": engine.runner.model.ops.name,
                                   "graph_batch_sizes": sorted(graphs.graphs) if graphs else []}  # fmt: skip
            except AssertionError as e:
                results[family] = {"matches": False, "error": str(e)[:500]}
    return results


FIRST_CALL = """
import json, sys, torch
from runtime.models.config import ModelConfig
from runtime.kernels import use_carried_cache
use_carried_cache()
from runtime.models.kernel_warmup import first_call_seconds
config = ModelConfig.from_dir(sys.argv[1])
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(json.dumps(first_call_seconds(config, getattr(torch, sys.argv[2]), device)))
"""


def first_call(dry: bool, bench_dirs: dict[str, Path]) -> dict:
    """Two fresh processes over one new Triton cache: the first compiles every kernel, the second loads them
    (at the first benchmark model's shapes)."""
    model_dir = next(iter(bench_dirs.values()))
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        for label in ("empty_cache", "carried_cache"):
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", FIRST_CALL, str(model_dir), "float32" if dry else "bfloat16"],
                                  env=env, capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
            kernels = json.loads(done.stdout.splitlines()[-1])
            runs[label] = {"process_s": time.perf_counter() - start, "kernels": kernels}
    return runs


def hf_throughput(model_dir: Path, prompts: list[list[int]], max_tokens: int, device: torch.device) -> float:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: one static batch, no padding
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1, :8], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        _sync(device)
    return len(prompts) * (len(prompts[0]) + max_tokens) / (time.perf_counter() - start)


def ours_throughput(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, device: torch.device
) -> tuple[float, float]:
    """(tokens/s, seconds to capture the decode graphs)."""
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    blocks = 2048 if device.type == "cuda" else 64
    sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b <= len(prompts))
    engine, capture_s = engine_on(model_dir, dtype, device, sizes, max_num_seqs=len(prompts), num_kv_blocks=blocks)
    generate(engine, [prompts[0][:8]], 2)  # warm-up: compiles the prefill shapes the graphs did not
    _sync(device)
    start = time.perf_counter()
    generate(engine, prompts, max_tokens)
    _sync(device)
    return len(prompts) * (len(prompts[0]) + max_tokens) / (time.perf_counter() - start), capture_s


def throughput(dry: bool, device: torch.device, bench_dirs: dict[str, Path], deadline: float) -> dict:
    batch, prompt_len, max_tokens = (2, 12, 4) if dry else (32, 256, 128)
    results: dict[str, Any] = {"batch": batch, "prompt_tokens": prompt_len, "max_tokens": max_tokens}
    for name, model_dir in bench_dirs.items():
        if time.monotonic() > deadline:
            results[name] = {"skipped": "past the time budget"}
            continue
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = [[(31 * i + 17 * r) % (vocab - 16) + 16 for i in range(prompt_len)] for r in range(batch)]
        ours, capture_s = ours_throughput(model_dir, prompts, max_tokens, device)
        hf = hf_throughput(model_dir, prompts, max_tokens, device)
        results[name] = {"ours_tok_s": ours, "transformers_tok_s": hf, "ratio": ours / hf, "graph_capture_s": capture_s}
    return results


def host_to_device(dry: bool, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    from snapshot.device_copy import copy_to_device

    tensors = {f"t{i}": torch.empty(64 << 20, dtype=torch.uint8) for i in range(16)}  # 1 GiB, pageable
    gib = sum(t.numel() for t in tensors.values()) / 2**30
    copy_to_device({"w": tensors["t0"]}, device)  # CUDA context and pinned pool warm
    out: dict[str, float] = {}
    for label, copy in (("staged_gib_s", lambda: copy_to_device(tensors, device)),
                        ("plain_to_gib_s", lambda: {k: t.to(device) for k, t in tensors.items()})):  # fmt: skip
        _sync(device)
        start = time.perf_counter()
        copy()
        _sync(device)
        out[label] = gib / (time.perf_counter() - start)
    out["ratio"] = out["staged_gib_s"] / out["plain_to_gib_s"]
    return out


def cold_start(dry: bool) -> dict:
    if dry:
        return {"skipped": "the dry run does not start servers"}
    cmd = [sys.executable, "benchmarks/cold_start.py", "--models", "smollm2-135m", "--rounds", "1", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    lines = done.stdout.strip().splitlines()
    try:
        return {"result": json.loads(lines[-1])}
    except (IndexError, json.JSONDecodeError):
        return {"returncode": done.returncode, "stdout_tail": lines[-20:], "stderr_tail": done.stderr[-2000:]}


# -- driver ---------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_bench_models(dry: bool, dirs: dict[str, Path]) -> dict[str, str]:
    """Random-weight models of the benchmark shapes (tiny families in the dry run) into ``dirs``, by name."""
    if dry:
        from tests.support.model_configs import FAMILIES

        out = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        for family in ("qwen3", "llama"):
            dirs[f"tiny-{family}"] = make_random_model(out / family, FAMILIES[family], seed=0, dtype="float32")
    for name in () if dry else BENCH_MODELS:
        out = Path.home() / ".cache" / "warmstart" / "bench" / f"{name}-bf16"
        if not (out / "config.json").is_file():
            make_random_model(out, SHARED_BENCH / "models" / f"{name}.json", seed=0, dtype="bfloat16")
        dirs[name] = out
    return {name: str(path) for name, path in dirs.items()}


def markdown(report: dict) -> str:
    lines = [f"# gpu_check {report['started']}", "", f"- device: {report['device']}",
             f"- torch {report['torch']}, triton {report['triton']}, total {report['total_s']:.0f} s", ""]  # fmt: skip
    for name, section in report["sections"].items():
        lines += [f"## {name} ({section.get('seconds', 0):.1f} s)", "", "```json",
                  json.dumps(section.get("result", section), indent=1, default=str)[:6000], "```", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (kernels interpreted)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--budget-s", type=float, default=450.0, help="no section starts after this many seconds")
    args = ap.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on the CPU")
    device = torch.device("cuda" if not dry else "cpu")
    if dry:
        os.environ["WARMSTART_KERNELS"] = "triton"
    start = time.monotonic()
    deadline = start + args.budget_s
    import triton

    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": dry,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.processor()})",
        "torch": torch.__version__, "triton": triton.__version__, "sections": {},
    }  # fmt: skip
    bench_dirs: dict[str, Path] = {}
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("kernels", lambda: kernels_tests(dry)),
        ("engine_vs_transformers", lambda: engine_vs_transformers(dry, device)),
        ("bench_models", lambda: make_bench_models(dry, bench_dirs)),
        ("first_call", lambda: first_call(dry, bench_dirs)),
        ("throughput", lambda: throughput(dry, device, bench_dirs, deadline)),
        ("host_to_device", lambda: host_to_device(dry, device)),
        ("cold_start", lambda: cold_start(dry)),
    ]
    for name, run in sections:
        if time.monotonic() > deadline:
            report["sections"][name] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            continue
        t0 = time.monotonic()
        try:
            result: Any = run()
            entry = {"result": result}
        except Exception as e:  # one failing section must not hide the others' figures
            entry = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        entry["seconds"] = time.monotonic() - t0
        report["sections"][name] = entry
        print(f"[gpu_check] {name}: {entry['seconds']:.1f} s {'ERROR ' + entry['error'] if 'error' in entry else ''}",
              flush=True)  # fmt: skip
    report["total_s"] = time.monotonic() - start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check-dry" if dry else "gpu_check"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(f"[gpu_check] wrote {args.out / stem}.json and .md in {report['total_s']:.0f} s")
    if any("error" in s for s in report["sections"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
