"""Structured outputs' cost: a batch where half the requests carry a JSON schema against the same batch with
none, and the grammar engine's compile times, cold and cached.

    python -m benchmarks.structured_outputs [--model ~/.cache/warmstart/models/smollm2] [--batch 16]
                                            [--new-tokens 64] [--rounds 3] [--dtype bfloat16]

--model defaults to SmolLM2-135M-Instruct as `warmstart prepare-model smollm2` leaves it (its real 49,152-token
vocabulary is what the masks are computed over), else a random SmolLM2-shaped model. The constrained requests'
schema holds an object with a long required string (minLength), so they keep decoding for all --new-tokens
(as the free ones do, with ignore_eos): both batches run the same number of steps at the same batch size, and
the ratio is the cost of filling and applying the masks. Greedy, 24-token prompts.

Compile times: building the tokenizer's grammar-engine view (once per model), a schema compiled cold, the
same schema again (the cache), and the per-step cost of one row's mask.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks import harness
from benchmarks.throughput import model_dir
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.structured_outputs import StructuredOutputsParams

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
    ap = harness.arguments(__doc__, rounds=3, warmup=1)
    ap.add_argument("--model", type=Path, default=REAL_MODEL if (REAL_MODEL / "config.json").is_file() else None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = harness.parse(ap)
    model = args.model or model_dir(CONFIG)
    llm = LLM.from_hf(model, dtype=args.dtype, max_num_seqs=args.batch, seed=0)
    times = compile_times(llm)
    print(f"model {model}, vocab {llm.engine.config.vocab_size}")
    print("grammar engine: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    assert llm.tokenizer is not None
    prompts = [llm.tokenizer.encode(f"Person number {i}: describe them as JSON with a long biography.")[:24]
               for i in range(args.batch)]
    run_batch(llm, prompts, args.batch // 2, 4)  # the schema's compile, before anything is timed

    def rate(constrained: int) -> float:
        seconds, tokens = run_batch(llm, prompts, constrained, args.new_tokens)
        return tokens / seconds

    rates = harness.alternate({"none": lambda: rate(0), "half": lambda: rate(args.batch // 2)}, args.rounds,
                              args.warmup)  # fmt: skip
    med, ratio = harness.medians(rates), harness.ratio(rates["half"], rates["none"])
    harness.report(args, {"model": str(model), "compile": times, "tok_s": rates, "half_over_none": ratio}, [
        f"batch {args.batch}, {args.new_tokens} new tokens each, median of {args.rounds}:",
        f"  unconstrained      {med['none']:8.1f} tokens/s   runs {' '.join(f'{r:.1f}' for r in rates['none'])}",
        f"  half JSON schema   {med['half']:8.1f} tokens/s   runs {' '.join(f'{r:.1f}' for r in rates['half'])}",
        f"  ratio (half / none) {harness.ratio_text(ratio)}"])


if __name__ == "__main__":
    main()
