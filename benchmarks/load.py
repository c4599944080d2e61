"""Time from nothing to a ready engine: our snapshot against safetensors + our engine and transformers.

    python -m benchmarks.load [--rounds 3] [--config ../shared/bench/models/smollm2-135m.json] [--json OUT]

Every system starts in a fresh process (a cold start is a fresh process) and loads the same model
(random weights, bf16). Rounds alternate systems. Each is run with the page cache warm, and cold: before a
cold run the model's files are dropped from the page cache with posix_fadvise(DONTNEED).

- snapshot: `snapshot.load(id)` from the local cache (no store traffic), weights mapped lazily.
- hf+engine: `runtime.LLM.from_hf(dir)`: safetensors read and converted to the engine's layout.
- transformers: `AutoModelForCausalLM.from_pretrained(dir)`.
- tensorizer / Run:ai model streamer: not installed in the project; skipped with a message.

Reported per system: imports (s), load (s: to a ready object), first token (s: one greedy token for a
16-token prompt, which touches every weight page), process total, and peak RSS. Ratios are to ours.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

T_START = time.perf_counter()

SHARED_BENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "bench"
PROMPT = list(range(100, 116))


def worker(system: str, model_dir: Path, snapshot_id: str, cache: Path) -> dict:
    t0 = time.perf_counter()
    if system == "snapshot":
        import warmstart.snapshot.loader as snapshot_load

        t1 = time.perf_counter()
        llm = snapshot_load.load(snapshot_id, cache=cache, num_kv_blocks=64)
        ready = time.perf_counter()
        first = _first_token_ours(llm)
    elif system == "hf+engine":
        from warmstart.runtime import LLM

        t1 = time.perf_counter()
        llm = LLM.from_hf(model_dir, dtype="bfloat16", num_kv_blocks=64)
        ready = time.perf_counter()
        first = _first_token_ours(llm)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        t1 = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        ready = time.perf_counter()
        with torch.no_grad():
            hf.generate(torch.tensor([PROMPT]), max_new_tokens=1, do_sample=False, pad_token_id=0)
        first = time.perf_counter()
    return {
        "imports_s": t1 - t0,
        "load_s": ready - t1,
        "first_token_s": first - ready,
        "process_s": first - T_START,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _first_token_ours(llm) -> float:  # type: ignore[no-untyped-def]
    from warmstart.runtime import SamplingParams

    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter()


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prepare(config: Path, workdir: Path) -> tuple[Path, str, Path, dict[str, list[Path]]]:
    from benchmarks.throughput import model_dir as bench_model_dir
    from warmstart.snapshot.build import BuildOptions, build_snapshot
    from warmstart.snapshot.cache import BlobCache

    model = bench_model_dir(config)
    cache_dir = workdir / "cache"
    built = build_snapshot(model, BuildOptions(dtype="bfloat16"), BlobCache(cache_dir))
    files = {
        "snapshot": list(built.blob_paths.values()),
        "hf+engine": sorted(model.iterdir()),
        "transformers": sorted(model.iterdir()),
    }
    return model, built.id, cache_dir, files


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3)
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--systems", nargs="+", default=["snapshot", "hf+engine", "transformers"])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--snapshot-id", help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = harness.parse(ap)
    if args.worker:
        print(json.dumps(worker(args.worker, args.model_dir, args.snapshot_id, args.cache)))
        return
    for name in ("tensorizer", "runai_model_streamer"):
        if importlib.util.find_spec(name) is None:
            print(f"{name}: skipped (not installed in this environment)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        model, sid, cache, files = prepare(args.config, Path(tmp))
        results: dict[str, dict[str, list[dict]]] = {s: {"warm": [], "cold": []} for s in args.systems}
        for _ in range(args.rounds):
            for state in ("warm", "cold"):
                for system in args.systems:
                    if state == "cold":
                        drop_page_cache(files[system])
                    cmd = harness.module_command("benchmarks.load", "--worker", system, "--model-dir", str(model),
                                                 "--snapshot-id", sid, "--cache", str(cache))
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=harness.REPO)
                    results[system][state].append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {"model": args.config.stem, "snapshot_id": sid, "rounds": args.rounds, "results": {}}
    for system, states in results.items():
        report["results"][system] = {
            state: {k: harness.median(r[k] for r in runs) for k in runs[0]} for state, runs in states.items()
        }
    print(f"model {args.config.stem} (bf16, random weights); medians of {args.rounds} rounds, fresh process each")
    header = f"{'system':<14}{'cache':<6}{'imports s':>10}{'load s':>10}{'1st token s':>12}{'process s':>10}"
    print(header + f"{'RSS MiB':>9}{'load / ours':>13}")
    for state in ("warm", "cold"):
        ours = report["results"].get("snapshot", {}).get(state, {}).get("load_s")
        for system in args.systems:
            r = report["results"][system][state]
            ratio = f"{r['load_s'] / ours:.1f}x" if ours else "-"
            print(f"{system:<14}{state:<6}{r['imports_s']:>10.3f}{r['load_s']:>10.3f}{r['first_token_s']:>12.3f}"
                  f"{r['process_s']:>10.3f}{r['peak_rss_mib']:>9.0f}{ratio:>13}")
    harness.report(args, report)


if __name__ == "__main__":
    main()
