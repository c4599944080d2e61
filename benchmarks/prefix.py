"""Time to first token behind a long prefix: KV loaded from a snapshot against computed on the spot.

    python benchmarks/prefix.py [--prefix-tokens 1024 2048] [--rounds 3] [--json]

The model is the SmolLM2-135M shape (random weights, bf16). For each prefix length a snapshot is built
with that prefix (`--prefix`); then, alternating, (a) the snapshot is loaded and one request made of the
prefix plus a short question is timed to its first token, and (b) the same request is timed on an engine
loaded from the HF directory, which must compute the prefix. Loading is not timed, nor the weight packing
that runs in the background after a start (benchmarks/cold_start.py times the whole start); the request is.
The bar is at least 10x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import model_dir as bench_model_dir  # noqa: E402
from benchmarks.workloads import SHARED_BENCH, text_of_tokens  # noqa: E402


def ttft(llm, prompt: list[int]) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    from warmstart.runtime import SamplingParams

    if llm.engine.prepack_thread is not None:
        llm.engine.prepack_thread.join()  # time the prefix, not the weight packing that follows a start
    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return time.perf_counter() - t, out.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--prefix-tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from warmstart.runtime import LLM
    from warmstart.runtime.tokenizer import Tokenizer
    from warmstart.snapshot.build import BuildOptions, PrefixSpec, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.loader import load

    model = bench_model_dir(args.config)
    tokenizer = Tokenizer(model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = BlobCache(Path(tmp) / "cache")
        for n in args.prefix_tokens:
            text = text_of_tokens(tokenizer, n)
            (Path(tmp) / "prefix.txt").write_text(text)
            spec = PrefixSpec("doc", Path(tmp) / "prefix.txt", "text")
            built = build_snapshot(model, BuildOptions(dtype="bfloat16", prefixes=[spec]), cache)
            prompt = tokenizer.encode(text + " Question: what does the document say about answers?")
            snap_times, fresh_times, cached = [], [], 0
            for _ in range(args.rounds):
                llm = load(built.id, cache=cache, num_kv_blocks=512)
                seconds, cached = ttft(llm, prompt)
                snap_times.append(seconds)
                del llm
                fresh = LLM.from_hf(model, dtype="bfloat16", num_kv_blocks=512)
                seconds, fresh_cached = ttft(fresh, prompt)
                assert fresh_cached == 0
                fresh_times.append(seconds)
                del fresh
            rows.append({"prefix_tokens": len(built.manifest.data["prefixes"][0]["token_ids"]),
                         "prompt_tokens": len(prompt), "cached_tokens": cached,
                         "ttft_snapshot_s": statistics.median(snap_times),
                         "ttft_computed_s": statistics.median(fresh_times),
                         "speedup": statistics.median(fresh_times) / statistics.median(snap_times)})
    if args.json:
        print(json.dumps({"model": args.config.stem, "rounds": args.rounds, "rows": rows}))
        return
    print(f"model {args.config.stem} (bf16, random weights), medians of {args.rounds} rounds")
    print(f"{'prefix':>7}{'prompt':>8}{'cached':>8}{'TTFT snapshot s':>17}{'TTFT computed s':>17}{'speedup':>9}")
    for r in rows:
        print(f"{r['prefix_tokens']:>7}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{r['ttft_snapshot_s']:>17.3f}"
              f"{r['ttft_computed_s']:>17.3f}{r['speedup']:>8.1f}x")


if __name__ == "__main__":
    main()
