"""The `warmstart` command line."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any

from handlers import snapshot_commands
from handlers.errors import CliError, positive_int

DEMO_CONFIG = "smollm2-135m.json"
DEMO_PROMPTS = (
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "Water boils at",
    "def add(a, b):",
    "The library opens at nine o'clock on",
    "Scientists study the stars to learn how",
    "My favourite colours are",
    "Please remember to close the window",
    "In 1969, astronauts",
    "The committee will meet again next",
    "Good software is simple,",
    "Can you tell me the way to",
    "Breakfast is served from seven until",
    "Mountains, rivers, forests and",
    "The children laughed, ran across the field and",
    "Music, painting, poetry and dance are",
)


def _default_cache() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "warmstart" / "demo-model"


def ensure_demo_model(model_dir: pathlib.Path, *, quiet: bool = False) -> pathlib.Path:
    """Build the random SmolLM2-135M-shaped demo model into `model_dir` unless it is already there."""
    if (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file() and any(
        model_dir.glob("*.safetensors")
    ):
        return model_dir
    from runtime import random_model

    config_path = pathlib.Path(random_model.__file__).parent / "configs" / DEMO_CONFIG
    config = json.loads(config_path.read_text())
    if not quiet:
        print(f"building a random SmolLM2-135M-shaped model in {model_dir} (once) ...", file=sys.stderr)
    tmp = model_dir.with_name(model_dir.name + f".tmp-{os.getpid()}")
    try:
        random_model.make_random_model(tmp, config, seed=0, dtype="bfloat16")
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, model_dir)  # another process may have won the race; then theirs is as good
    except OSError as e:
        if not (model_dir / "config.json").is_file():
            raise CliError(f"cannot write the demo model to {model_dir}: {e} (try --model-dir DIR)") from None
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def cmd_demo(args: argparse.Namespace) -> int:
    model_dir = pathlib.Path(args.model_dir).expanduser() if args.model_dir else _default_cache()
    ensure_demo_model(model_dir, quiet=args.json)
    try:
        from runtime import LLM, SamplingParams
    except ImportError as e:
        raise CliError(f"the engine is not available: {e}") from None

    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.num_prompts)]
    t0 = time.perf_counter()
    llm = LLM.from_hf(str(model_dir), dtype="bfloat16")
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params)
    gen_s = time.perf_counter() - t1

    generated = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(_prompt_len(llm, o, p) for o, p in zip(outs, prompts, strict=True))
    result: dict[str, Any] = {
        "model_dir": str(model_dir),
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "load_s": round(load_s, 3),
        "generate_s": round(gen_s, 3),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "generated_tokens_per_s": round(generated / gen_s, 2) if gen_s > 0 else None,
        "total_tokens_per_s": round((prompt_tokens + generated) / gen_s, 2) if gen_s > 0 else None,
        "samples": [{"prompt": p, "text": o.text, "token_ids": list(o.token_ids)} for p, o in
                    list(zip(prompts, outs, strict=True))[:2]],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    for sample in result["samples"]:
        print(f"prompt: {sample['prompt']!r}")
        print(f"  text: {sample['text']!r}")
        print(f"  token_ids: {sample['token_ids'][:16]}{' ...' if len(sample['token_ids']) > 16 else ''}")
    print(f"model loaded in {load_s:.2f} s; {len(prompts)} prompts, {prompt_tokens} prompt + "
          f"{generated} generated tokens in {gen_s:.2f} s")
    print(f"generated tokens/s: {result['generated_tokens_per_s']}; total (prompt+generated) tokens/s: "
          f"{result['total_tokens_per_s']}")
    print("(random weights: the text is gibberish by design)")
    return 0


def _prompt_len(llm: Any, out: Any, prompt: str) -> int:
    ids = getattr(out, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    tokenizer = getattr(llm, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "encode"):
        encoded = tokenizer.encode(prompt)
        return len(getattr(encoded, "ids", encoded))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmstart", description="Cold-start-optimized LLM runtime.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="build a random SmolLM2-135M-shaped model and generate with it")
    demo.add_argument("--model-dir", help="demo model directory (default ~/.cache/warmstart/demo-model)")
    demo.add_argument("--num-prompts", type=positive_int, default=16)
    demo.add_argument("--max-tokens", type=positive_int, default=64)
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    demo.set_defaults(func=cmd_demo)
    snapshot_commands.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except CliError as e:
        print(f"warmstart: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
