"""Everything the CUDA path needs checked on a GPU, in one run of under 8 minutes on one H200.

    python -m benchmarks.gpu_check [--out benchmarks/results] [--budget-s 400] [--sections served ...]
    python -m benchmarks.gpu_check --dry-run     # on the CPU: every section at toy size (a test runs this)

Sections, in order of what they prove; each is timed, a failing one is recorded and the next runs, and a
section (or a model inside one) that the budget leaves no time for is skipped with a message. Child
processes get what is left of the budget as their timeout, so the run ends within --budget-s plus one step:
1. host_to_device: 1 GB pinned and pageable, one copy each, and snapshot.device_copy's staged copy against a
   plain `.to("cuda")`: the bus the cold start's device copy is measured against.
2. served (benchmarks/gpu_served.py): `warmstart serve --device cuda` as a real process on snapshots of random
   SmolLM2-135M- and Llama-3.2-1B-shaped models (bf16): cold start with empty and with warm blob and Triton
   caches (ready, first token, the server's timeline with device_copy GB/s against the pinned bus), greedy
   tokens against transformers on the same GPU, and served throughput and TTFT against
   benchmarks/hf_handler.py on the same GPU, side by side with the ratio.
3. engine_vs_transformers: every tiny model family on CUDA (Triton kernels, decode CUDA graphs) against
   transformers' greedy tokens in float32.
   bf16_drift (benchmarks/bf16_drift.py): the served models' last-position logits from float32, ours in bfloat16
   against transformers in bfloat16 (the bf16 verdict: bf16 greedy runs of random-weight models part early).
4. bench_models, first_call: each kernel's first call (compile) and second call at SmolLM2-135M's shapes,
   with an empty Triton cache and again in a fresh process over the cache the first filled.
5. throughput: ours (bf16, CUDA, kernels + graphs) and transformers (bf16, CUDA, one static batch) on the
   SmolLM2-135M, Qwen2.5-0.5B and Llama-3.2-1B shapes in-process, side by side, and the ratio.
6. kernels: the `kernels` tests, compiled (not interpreted), in what is left of the budget.
Writes gpu_check.json and gpu_check.md under --out. The model configs are in benchmarks/models/ (copies of
../shared/bench/models/, which does not travel to the device machine).

On the device machine (its image has torch, triton, transformers, httpx and the rest, but not starlette,
uvicorn or boto3): first, here, `benchmarks/device_wheels.sh` (downloads those wheels into the ignored
folder .whl/), then call the device tool's `run` with carry [".whl"], timeout_s 560 and the command

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && mkdir /tmp/site/warmstart && for f in runtime snapshot handlers; do ln -s $PWD/$f \
      /tmp/site/warmstart/$f; done && export PYTHONPATH=/tmp/site || exit; set -o pipefail; PYTHONUNBUFFERED=1 \
      python3 -m benchmarks.gpu_check --out $OUT 2>&1 | tee $OUT/log.txt

(the links make this checkout's folders importable as warmstart.runtime, ... without installing it, as setup.py
maps them).

and copy the figures from gpu_check.md into docs/BENCHMARKS.md. A rerun of one section in what is left of
the 15 minutes: the same with `--sections served --budget-s 200`.
"""

from __future__ import annotations

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

from benchmarks import harness  # noqa: E402
from warmstart.runtime.engine.cuda_graphs import DEFAULT_BATCH_SIZES  # noqa: E402
from warmstart.runtime.engine.engine import LLMEngine  # noqa: E402
from warmstart.runtime.engine.model_runner import GRAPHS_ENV  # noqa: E402
from warmstart.runtime.engine.options import EngineOptions  # noqa: E402
from warmstart.runtime.models.config import ModelConfig  # noqa: E402
from warmstart.runtime.models.weights import ModelWeights, load_weights  # noqa: E402
from warmstart.runtime.random_model import make_random_model  # noqa: E402
from warmstart.runtime.sampling_params import SamplingParams  # noqa: E402

BENCH_MODELS = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b")
BENCH_CONFIGS = ROOT / "benchmarks" / "models"


def child_env(**extra: str) -> dict[str, str]:
    """A child process's environment: the repository importable, ahead of what PYTHONPATH already holds (on the
    device machine, the carried wheels), and no API key, so the servers take plain requests."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, **extra}
    env.pop("WARMSTART_API_KEY", None)
    return env


def left(deadline: float) -> float:
    return deadline - time.monotonic()


def bench_model_dir(name: str) -> Path:
    """The random-weight bf16 model of benchmarks/models/NAME.json, built once into the user's cache."""
    out = Path.home() / ".cache" / "warmstart" / "bench" / f"{name}-bf16"
    if not (out / "config.json").is_file():
        make_random_model(out, BENCH_CONFIGS / f"{name}.json", seed=0, dtype="bfloat16")
    return out


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


def kernels_tests(dry: bool, deadline: float) -> dict:
    if dry:
        return {"skipped": "the dry run leaves the kernels tests to the normal test command"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "kernels", "-p", "no:cacheprovider",
           "tests/runtime/test_kernels.py", "tests/runtime/test_kernels_attention.py",
           "tests/runtime/test_kernels_quant.py"]  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, left(deadline)),
                              env=child_env())
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"passed": None, "stopped": "at the end of the time budget", "tail": out.splitlines()[-15:]}
    tail = done.stdout.strip().splitlines()[-15:]
    return {"passed": done.returncode == 0, "summary": tail[-1] if tail else "", "tail": tail}


def engine_vs_transformers(dry: bool, device: torch.device, deadline: float) -> dict:
    from tests.support.model_configs import FAMILIES
    from tests.support.reference import assert_matches_reference

    families = ["llama3"] if dry else sorted(FAMILIES)
    max_tokens = 3 if dry else 8
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            if left(deadline) < 10:
                results[family] = {"skipped": "past the time budget"}
                continue
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
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.kernels import use_carried_cache
use_carried_cache()
from benchmarks.kernel_first_calls import first_call_seconds
config = ModelConfig.from_dir(sys.argv[1])
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(json.dumps(first_call_seconds(config, getattr(torch, sys.argv[2]), device)))
"""


def first_call(dry: bool, bench_dirs: dict[str, Path], deadline: float) -> dict:
    """Two fresh processes over one new Triton cache: the first compiles every kernel, the second loads them
    (at the first benchmark model's shapes)."""
    model_dir = next(iter(bench_dirs.values()))
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        env = child_env(TRITON_CACHE_DIR=cache)
        for label in ("empty_cache", "carried_cache"):
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", FIRST_CALL, str(model_dir), "float32" if dry else "bfloat16"],
                                  env=env, capture_output=True, text=True, timeout=max(1.0, left(deadline)),
                                  check=True, cwd=ROOT)  # fmt: skip
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
        if left(deadline) < 45:  # the Llama-3.2-1B shape takes about that, ours and transformers'
            results[name] = {"skipped": "past the time budget"}
            continue
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = [[(31 * i + 17 * r) % (vocab - 16) + 16 for i in range(prompt_len)] for r in range(batch)]
        ours, capture_s = ours_throughput(model_dir, prompts, max_tokens, device)
        hf = hf_throughput(model_dir, prompts, max_tokens, device)
        results[name] = {"ours_tok_s": ours, "transformers_tok_s": hf, "ratio": ours / hf, "graph_capture_s": capture_s}
    return results


def timed_gb_s(copy: Callable[[], Any], nbytes: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    copy()
    _sync(device)
    return nbytes / (time.perf_counter() - start) / 1e9


def host_to_device(device: torch.device) -> dict:
    """GB/s (1e9 bytes) host to device: one pinned and one pageable 1 GB copy (the bus, as a loader could at best
    use it), then 1 GB in 16 pageable tensors through snapshot.device_copy's staged copy against plain `.to`."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    from warmstart.snapshot.device_copy import copy_to_device

    nbytes = 1_000_000_000
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned.to(device, non_blocking=True)  # the CUDA context and the copy engines awake
    out: dict[str, Any] = {
        "pinned_gb_s": timed_gb_s(lambda: pinned.to(device, non_blocking=True), nbytes, device),
        "pageable_gb_s": timed_gb_s(lambda: pageable.to(device), nbytes, device),
    }
    tensors = {f"t{i}": torch.empty(nbytes // 16, dtype=torch.uint8) for i in range(16)}
    copy_to_device({"w": tensors["t0"]}, device)  # the staging buffers allocated
    out["staged_gb_s"] = timed_gb_s(lambda: copy_to_device(tensors, device), nbytes, device)
    out["plain_to_gb_s"] = timed_gb_s(lambda: {k: t.to(device) for k, t in tensors.items()}, nbytes, device)
    out["staged_vs_plain"] = out["staged_gb_s"] / out["plain_to_gb_s"]
    return out


# -- driver ---------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_drift_section(dry: bool, device: torch.device, deadline: float) -> dict:
    """Logit drift from float32, ours in bfloat16 against transformers in bfloat16 (benchmarks/bf16_drift.py):
    the bf16 verdict, since two bf16 greedy runs of a random-weight model part within a few tokens."""
    from benchmarks.bf16_drift import drift, verdict
    from benchmarks.gpu_served import SERVED_MODELS

    models = {"tiny-llama": tiny_model("llama")} if dry else {name: bench_model_dir(name) for name in SERVED_MODELS}
    # Six prompts in the dry run: the mean of two was as noisy as the limit is wide (1.1-1.5 across CPU kinds).
    lens = [7, 12, 20, 30, 45, 64] if dry else [7, 60, 200, 400]
    results: dict[str, Any] = {}
    for name, model_dir in models.items():
        if left(deadline) < 20:
            results[name] = {"skipped": "past the time budget"}
            continue
        results[name] = verdict(drift(model_dir, device, lens))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def tiny_model(family: str) -> Path:
    from tests.support.model_configs import FAMILIES

    out = Path(tempfile.mkdtemp(prefix="gpu-check-")) / family
    return make_random_model(out, FAMILIES[family], seed=0, dtype="float32")


def make_bench_models(dry: bool, dirs: dict[str, Path]) -> dict[str, str]:
    """Random-weight models of the benchmark shapes (tiny families in the dry run) into ``dirs``, by name."""
    for family in ("qwen3", "llama") if dry else ():
        dirs[f"tiny-{family}"] = tiny_model(family)
    for name in () if dry else BENCH_MODELS:
        dirs[name] = bench_model_dir(name)
    return {name: str(path) for name, path in dirs.items()}


def served_section(dry: bool, device: torch.device, deadline: float, host_to_device: dict[str, Any]) -> dict:
    from benchmarks.gpu_served import SERVED_MODELS, served

    if device.type == "cuda":
        torch.cuda.empty_cache()  # what earlier sections cached is the servers' to use
    models = {"tiny-llama": tiny_model("llama")} if dry else {name: bench_model_dir(name) for name in SERVED_MODELS}
    return served(dry, device, deadline, child_env(), models, host_to_device)


def failures(report: dict[str, Any]) -> list[str]:
    """What in the report says the CUDA path is wrong (not what the budget skipped)."""
    out = []
    for name, section in report["sections"].items():
        if "error" in section:
            out.append(f"{name}: {section['error']}")
        result = section.get("result")
        if not isinstance(result, dict):
            continue
        if name == "kernels" and result.get("passed") is False:
            out.append(f"kernels: {result.get('summary')}")
        for key, row in result.items():
            if not isinstance(row, dict):
                continue
            if "error" in row:
                out.append(f"{name} {key}: {str(row['error'])[:300]}")
            if row.get("matches") is False or row.get("greedy", {}).get("matches") is False:
                out.append(f"{name} {key}: differs from transformers")
    return out


# Seconds a section needs to be worth starting (served and throughput also check per model).
MIN_SECONDS = {"host_to_device": 10, "served": 60, "engine_vs_transformers": 30, "bf16_drift": 30,
               "bench_models": 20, "first_call": 30, "throughput": 30, "kernels": 30}


def markdown(report: dict) -> str:
    lines = [f"# gpu_check {report['started']}", "", f"- device: {report['device']}",
             f"- torch {report['torch']} (CUDA {report['cuda']}), triton {report['triton']}, "
             f"total {report['total_s']:.0f} s", ""]  # fmt: skip
    for name, section in report["sections"].items():
        lines += [f"## {name} ({section.get('seconds', 0):.1f} s)", "", "```json",
                  json.dumps(section.get("result", section), indent=1, default=str)[:8000], "```", ""]  # fmt: skip
    if report["failures"]:
        lines += ["## failures", "", *[f"- {f}" for f in report["failures"]], ""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path, start: float) -> None:
    report["total_s"] = time.monotonic() - start
    report["failures"] = failures(report)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check-dry" if report["dry_run"] else "gpu_check"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{stem}.md").write_text(markdown(report))


def main() -> None:
    ap = harness.arguments(__doc__, rounds=None, json_out=False)
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (kernels interpreted)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="the run's time: sections are skipped, and child processes stopped, past it (default 400)")
    ap.add_argument("--sections", nargs="+", choices=list(MIN_SECONDS), help="run only these (default: all)")
    args = harness.parse(ap)
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
        "machine": harness.machine(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "sections": {},
    }  # fmt: skip
    bench_dirs: dict[str, Path] = {}

    def h2d() -> dict[str, Any]:
        return report["sections"].get("host_to_device", {}).get("result", {})  # type: ignore[no-any-return]

    sections: list[tuple[str, Callable[[], Any]]] = [
        ("host_to_device", lambda: host_to_device(device)),
        ("served", lambda: served_section(dry, device, deadline, h2d())),
        ("engine_vs_transformers", lambda: engine_vs_transformers(dry, device, deadline)),
        ("bf16_drift", lambda: bf16_drift_section(dry, device, deadline)),
        ("bench_models", lambda: make_bench_models(dry, bench_dirs)),
        ("first_call", lambda: first_call(dry, bench_dirs, deadline)),
        ("throughput", lambda: throughput(dry, device, bench_dirs, deadline)),
        ("kernels", lambda: kernels_tests(dry, deadline)),
    ]
    for name, run in sections:
        if args.sections and name not in args.sections:
            continue
        if left(deadline) < MIN_SECONDS[name]:
            report["sections"][name] = {"skipped": f"{max(0.0, left(deadline)):.0f} s of the {args.budget_s:.0f} s "
                                                   f"budget left; the section needs {MIN_SECONDS[name]} s"}
            print(f"[gpu_check] {name}: skipped, {report['sections'][name]['skipped']}", flush=True)
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
        write_report(report, args.out, start)  # what is done survives a run stopped from outside
    write_report(report, args.out, start)
    stem = "gpu_check-dry" if dry else "gpu_check"
    for failure in report["failures"]:
        print(f"[gpu_check] FAILED {failure}")
    print(f"[gpu_check] wrote {args.out / stem}.json and .md in {report['total_s']:.0f} s")
    if report["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
