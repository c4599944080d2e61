"""Structured outputs' cost: a batch where half the requests carry a JSON schema against the same batch with
none, and the grammar engine's compile times, cold and cached.

    python benchmarks/structured_outputs.py [--model ~/.cache/warmstart/models/smollm2] [--batch 16]
                                            [--new-tokens 64] [--repeats 3] [--dtype bfloat16]

--model defaults to SmolLM2-135M-Instruct as `warmstart prepare-model smollm2` leaves it (its real 49,152-token
vocabulary is what the masks are computed over), else a random SmolLM2-shaped model. The constrained requests'
schema holds an object with a long required string (minLength), so they keep decoding for all --new-tokens
(as the free ones do, with ignore_eos): both batches run the same number of steps at the same batch size, and
the ratio is the cost of filling and applying the masks. Greedy, 24-token prompts.

Compile times: building the tokenizer's grammar-engine view (once per model), a schema compiled cold, the
same schema again (the cache), and the per-step cost of one row's mask.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.throughput import model_dir  # noqa: E402
from warmstart.runtime import LLM, SamplingParams  # noqa: E402
from warmstart.runtime.structured_outputs import StructuredOutputsParams  # noqa: E402

REAL_MODEL = Path.home() / ".cache" / "warmstart" / "models" / "smollm2"
CONFIG = Path(__file__).resolve().parent / "models" / "smollm2-135m.json"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "bio": {"type": "string", "minLength": 2000},
    },
    "required": ["name", "age", "role", "tags", "bio"],
    "additionalProperties": False,
}


def run_batch(llm: LLM, prompts: list[list[int]], constrained: int, new_tokens: int) -> tuple[float, int]:
    spec = StructuredOutputsParams(json=PERSON)
    params = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                             structured_outputs=spec if i < constrained else None) for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert all(len(o.token_ids) == new_tokens for o in outs), "a request ended early: the batches would differ"
    return seconds, tokens


def compile_times(llm: LLM) -> dict[str, float]:
    from warmstart.runtime.engine.structured import GrammarCompiler

    engine = llm.engine
    assert engine.tokenizer is not None
    start = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer.hf.to_str(), engine.config.vocab_size, sorted(engine.eos_token_ids))
    tokenizer_s = time.perf_counter() - start
    spec = StructuredOutputsParams(json=PERSON)
    start = time.perf_counter()
    compiler.compile(spec)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(100):
        compiler.compile(StructuredOutputsParams(json=PERSON))  # a fresh request: parsed, hashed, looked up
    cached_s = (time.perf_counter() - start) / 100
    import torch

    # One row's mask at every position of a valid document, averaged (inside a string it is cheap, at a key dear).
    matcher = compiler.matcher(spec)
    row = torch.empty(-(-engine.config.vocab_size // 32), dtype=torch.int32)
    document = '{"name": "Ann Lee", "age": 37, "role": "user", "tags": ["x", "yz"], "bio": "' + "Born in Oslo. " * 4
    tokens = engine.tokenizer.encode(document, add_special_tokens=False)
    start = time.perf_counter()
    for token in tokens:
        matcher.fill_bitmask(row)
        assert matcher.accept(token)
    mask_s = (time.perf_counter() - start) / len(tokens)
    return {"tokenizer_view_ms": tokenizer_s * 1e3, "compile_cold_ms": cold_s * 1e3,
            "compile_cached_ms": cached_s * 1e3, "mask_per_row_ms": mask_s * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REAL_MODEL if (REAL_MODEL / "config.json").is_file() else None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    model = args.model or model_dir(CONFIG)
    llm = LLM.from_hf(model, dtype=args.dtype, max_num_seqs=args.batch, seed=0)
    times = compile_times(llm)
    print(f"model {model}, vocab {llm.engine.config.vocab_size}")
    print("grammar engine: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    assert llm.tokenizer is not None
    prompts = [llm.tokenizer.encode(f"Person number {i}: describe them as JSON with a long biography.")[:24]
               for i in range(args.batch)]
    run_batch(llm, prompts, args.batch // 2, 4)  # warm-up (and the schema's compile)
    rates: dict[str, list[float]] = {"none": [], "half": []}
    for _ in range(args.repeats):  # interleaved, so that a busy machine slows both alike
        for name, constrained in (("none", 0), ("half", args.batch // 2)):
            seconds, tokens = run_batch(llm, prompts, constrained, args.new_tokens)
            rates[name].append(tokens / seconds)
    none, half = statistics.median(rates["none"]), statistics.median(rates["half"])
    print(f"batch {args.batch}, {args.new_tokens} new tokens each, median of {args.repeats}:")
    print(f"  unconstrained      {none:8.1f} tokens/s   runs {' '.join(f'{r:.1f}' for r in rates['none'])}")
    print(f"  half JSON schema   {half:8.1f} tokens/s   runs {' '.join(f'{r:.1f}' for r in rates['half'])}")
    print(f"  ratio              {half / none:8.3f}")


if __name__ == "__main__":
    main()
