"""Time to first token behind a long prefix: KV loaded from a snapshot against computed on the spot.

    python -m benchmarks.prefix [--prefix-tokens 1024 2048] [--rounds 3] [--json OUT]

The model is the SmolLM2-135M shape (random weights, bf16). For each prefix length a snapshot is built
with that prefix (`--prefix`); then, alternating, (a) the snapshot is loaded and one request made of the
prefix plus a short question is timed to its first token, and (b) the same request is timed on an engine
loaded from the HF directory, which must compute the prefix. Loading is not timed, nor the weight packing
that runs in the background after a start (benchmarks/cold_start.py times the whole start); the request is.
The bar is at least 10x.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.throughput import model_dir as bench_model_dir
from benchmarks.workloads import SHARED_BENCH, text_of_tokens


def ttft(llm, prompt: list[int]) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    from warmstart.runtime import SamplingParams

    if llm.engine.prepack_thread is not None:
        llm.engine.prepack_thread.join()  # time the prefix, not the weight packing that follows a start
    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return time.perf_counter() - t, out.cached_tokens


def measure(model: Path, tmp: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Alternating rounds of one request behind a prefix of ``n`` tokens: from a snapshot, and computed."""
    from warmstart.runtime import LLM
    from warmstart.runtime.tokenizer import Tokenizer
    from warmstart.snapshot.build import BuildOptions, PrefixSpec, build_snapshot
    from warmstart.snapshot.cache import BlobCache
    from warmstart.snapshot.loader import load

    tokenizer = Tokenizer(model)
    cache = BlobCache(tmp / "cache")
    text = text_of_tokens(tokenizer, n)
    (tmp / "prefix.txt").write_text(text)
    spec = PrefixSpec("doc", tmp / "prefix.txt", "text")
    built = build_snapshot(model, BuildOptions(dtype="bfloat16", prefixes=[spec]), cache)
    prompt = tokenizer.encode(text + " Question: what does the document say about answers?")
    cached = []

    def from_snapshot() -> float:
        seconds, hit = ttft(load(built.id, cache=cache, num_kv_blocks=512), prompt)
        cached.append(hit)
        return seconds

    def computed() -> float:
        seconds, hit = ttft(LLM.from_hf(model, dtype="bfloat16", num_kv_blocks=512), prompt)
        assert hit == 0, "the engine from the HF directory found the prefix cached"
        return seconds

    times = harness.alternate({"snapshot": from_snapshot, "computed": computed}, args.rounds, args.warmup)
    median = harness.medians(times)
    return {"prefix_tokens": len(built.manifest.data["prefixes"][0]["token_ids"]), "prompt_tokens": len(prompt),
            "cached_tokens": cached[-1], "ttft_snapshot_s": median["snapshot"], "ttft_computed_s": median["computed"],
            "speedup": harness.ratio(times["computed"], times["snapshot"])}


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3, warmup=0)
    ap.add_argument("--config", type=Path, default=SHARED_BENCH / "models" / "smollm2-135m.json")
    ap.add_argument("--prefix-tokens", type=int, nargs="+", default=[1024, 2048])
    args = harness.parse(ap)

    model = bench_model_dir(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(model, Path(tmp), n, args) for n in args.prefix_tokens]
    lines = [f"model {args.config.stem} (bf16, random weights), medians of {args.rounds} rounds",
             f"{'prefix':>7}{'prompt':>8}{'cached':>8}{'TTFT snapshot s':>17}{'TTFT computed s':>17}  speedup"]
    lines += [f"{r['prefix_tokens']:>7}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{r['ttft_snapshot_s']:>17.3f}"
              f"{r['ttft_computed_s']:>17.3f}  {harness.ratio_text(r['speedup'])}" for r in rows]
    harness.report(args, {"model": args.config.stem, "rounds": args.rounds, "rows": rows}, lines)


if __name__ == "__main__":
    main()
