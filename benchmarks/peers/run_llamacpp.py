"""Throughput runner for llama.cpp through llama-cpp-python, run as a subprocess by the benchmark.

Run it with the peer venv's python (see README.md in this folder):

    OMP_NUM_THREADS=2 /work/peers/llamacpp/.venv/bin/python run_llamacpp.py \
        --model-dir DIR --requests requests.json --out result.json [--max-num-seqs 16] [--arrival honoured]

requests.json: a list of {"prompt_token_ids": [...], "max_tokens": N, "arrival_s": float}.

The HF model directory is converted once to GGUF (bf16 by default) with llama.cpp's own
convert_hf_to_gguf.py (see llamacpp_convert.py) and cached under --gguf-cache, keyed by the model
files' path, size and mtime; --gguf PATH uses a ready GGUF instead. --outtype q8_0 / q4_0 quantize
the f32 GGUF with llama.cpp's llama_model_quantize (what the llama-quantize tool does, its default
choices: for q4_0 SmolLM2's tied embedding/head, 576 wide, stays q8_0), also cached.

Decoding uses llama.cpp's low-level API the way llama-server does continuous batching: one context
with n_seq_max = --max-num-seqs sequences (one KV stream per sequence, kv_unified=false); each step
is one llama_decode of a llama_batch holding one token for every sequence that is decoding plus
prompt tokens of newly admitted sequences up to the --n-batch budget (chunked prefill). A finished
sequence's KV is dropped (llama_memory_seq_rm) and its slot goes to the next waiting request.
Token ids go in directly, sampling is greedy (argmax of the logits) and EOS is ignored, so every
request generates exactly max_tokens tokens.

--arrival honoured (default): a request joins the waiting queue once arrival_s has passed since the
start of the timed window; burst: all requests are there at t=0.

Output JSON: engine, arrival, wall_s (timed window only, after load and warm-up), prompt_tokens,
generated_tokens, gen_tok_s, total_tok_s, ttft_s (per request, input order, from arrival to its
first sampled token), load_s (GGUF load + context creation + warm-up), convert_s (0 when cached),
and the settings used.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTTYPES = ("bf16", "f32", "f16", "q8_0", "q4_0")
QUANTIZED = {"q8_0": 7, "q4_0": 2}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_0


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--arrival", choices=("honoured", "burst"), default="honoured")
    p.add_argument("--outtype", default="bf16", choices=OUTTYPES,
                   help="GGUF weight type (default bf16; q8_0/q4_0: quantized by llama_model_quantize)")
    p.add_argument("--gguf", default=None, help="use this GGUF file instead of converting --model-dir")
    p.add_argument("--gguf-cache", default=os.environ.get("LLAMACPP_GGUF_CACHE")
                   or str(Path(sys.prefix).resolve().parent / "gguf-cache"))
    p.add_argument("--n-batch", type=int, default=2048,
                   help="token budget of one llama_decode step (default 2048, as llama-server)")
    p.add_argument("--n-ubatch", type=int, default=512, help="physical micro-batch (default 512, as llama.cpp)")
    p.add_argument("--threads", type=int, default=0, help="0: $OMP_NUM_THREADS, else os.cpu_count()")
    p.add_argument("--kv-type", default="f16", choices=("f16", "bf16", "f32"), help="KV cache type (default f16)")
    p.add_argument("--flash-attn", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--repeat", type=int, default=1,
                   help="timed rounds over all requests after one load; the median-wall round is reported")
    p.add_argument("--save-tokens", action="store_true", help="write output_token_ids (per request) too")
    p.add_argument("--verbose", action="store_true", help="keep llama.cpp's log output")
    return p.parse_args()


def _gguf_for(args) -> tuple[Path, float]:
    if args.gguf:
        return Path(args.gguf), 0.0
    md = Path(args.model_dir).resolve()
    h = hashlib.sha256(str(md).encode())
    for f in sorted(md.iterdir()):
        if f.suffix in (".json", ".safetensors", ".model") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    cache = Path(args.gguf_cache)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{md.name}-{h.hexdigest()[:16]}-{args.outtype}.gguf"
    if out.is_file():
        return out, 0.0
    t0 = time.perf_counter()
    tmp = out.with_suffix(".tmp.gguf")
    if args.outtype in QUANTIZED:
        import llama_cpp.llama_cpp as L

        source, _ = _gguf_for(argparse.Namespace(**{**vars(args), "outtype": "f32"}))
        L.llama_backend_init()
        params = L.llama_model_quantize_default_params()
        params.ftype = QUANTIZED[args.outtype]
        params.nthread = int(os.environ.get("OMP_NUM_THREADS") or 0)
        if L.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama_model_quantize {source} -> {args.outtype} failed")
    else:
        subprocess.run([sys.executable, str(HERE / "llamacpp_convert.py"), str(md), str(tmp),
                        "--outtype", args.outtype], check=True, stdout=sys.stderr)
    tmp.rename(out)
    return out, time.perf_counter() - t0


def main() -> int:
    args = _parse()
    with open(args.requests) as f:
        reqs = json.load(f)
    if not reqs:
        raise SystemExit("no requests")
    gguf_path, convert_s = _gguf_for(args)

    import llama_cpp
    import llama_cpp.llama_cpp as L
    import numpy as np

    if not args.verbose:
        @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
        def _quiet(level, text, user_data):  # ggml_log_level: WARN=3, ERROR=4 shown; DEBUG/INFO/CONT dropped
            if level in (3, 4) and text:
                sys.stderr.write(text.decode(errors="replace"))
        L.llama_log_set(_quiet, None)
        globals()["_keep_log_cb"] = _quiet

    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or (os.cpu_count() or 1)
    n_seq = max(1, args.max_num_seqs)
    max_len = max(len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in reqs)
    ctx_per_seq = (max_len + 1 + 255) // 256 * 256
    kv_types = {"f16": 1, "f32": 0, "bf16": 30}  # ggml_type
    fa = {"auto": -1, "off": 0, "on": 1}[args.flash_attn]

    t0 = time.perf_counter()
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.use_mmap = True
    model = L.llama_model_load_from_file(str(gguf_path).encode(), mparams)
    if not model:
        raise SystemExit(f"failed to load {gguf_path}")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)

    cparams = L.llama_context_default_params()
    cparams.n_ctx = ctx_per_seq * n_seq
    cparams.n_batch = args.n_batch
    cparams.n_ubatch = min(args.n_ubatch, args.n_batch)
    cparams.n_seq_max = n_seq
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.kv_unified = False
    cparams.type_k = kv_types[args.kv_type]
    cparams.type_v = kv_types[args.kv_type]
    cparams.flash_attn_type = fa
    cparams.no_perf = True
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("failed to create llama context")
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(args.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, pos, seq_id, want_logits)."""
        for i, (tok, pos, sid, lg) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sid
            batch.logits[i] = 1 if lg else 0
        batch.n_tokens = len(entries)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(i: int) -> int:
        ptr = L.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    def run(batch_reqs: list[dict], honour: bool) -> tuple[list[int], list[float | None], float, list[list[int]]]:
        """Continuous batching over batch_reqs; returns generated counts, TTFTs, wall time and output ids."""
        n = len(batch_reqs)
        order = sorted(range(n), key=lambda i: float(batch_reqs[i].get("arrival_s", 0.0)) if honour else 0.0)
        base = min(float(r.get("arrival_s", 0.0)) for r in batch_reqs) if honour else 0.0
        arrive = [float(batch_reqs[i].get("arrival_s", 0.0)) - base if honour else 0.0 for i in range(n)]
        pending = collections.deque(order)           # not yet arrived
        waiting: collections.deque[int] = collections.deque()  # arrived, no slot yet
        free_slots = list(range(n_seq - 1, -1, -1))
        # per active request: slot, prompt position consumed, generated tokens, last token
        active: dict[int, dict] = {}
        gen = [0] * n
        out_ids: list[list[int]] = [[] for _ in range(n)]
        ttft: list[float | None] = [None] * n
        L.llama_memory_clear(mem, True)
        t_start = time.perf_counter()
        done = 0
        while done < n:
            now = time.perf_counter() - t_start
            while pending and arrive[pending[0]] <= now:
                waiting.append(pending.popleft())
            while waiting and free_slots:
                i = waiting.popleft()
                active[i] = {"slot": free_slots.pop(), "fed": 0, "last": None, "n": 0}
            if not active:
                time.sleep(max(0.0, min(arrive[pending[0]] - now, 0.05)))
                continue
            entries: list[tuple[int, int, int, bool]] = []
            owners: list[tuple[int, str]] = []  # (request, "gen"|"prefill-last") for rows with logits
            # 1) one decode token for every sequence that has finished its prompt
            for i, st in active.items():
                if st["last"] is not None:
                    plen = len(batch_reqs[i]["prompt_token_ids"])
                    entries.append((st["last"], plen + st["n"] - 1, st["slot"], True))
                    owners.append((i, len(entries) - 1))
            # 2) fill the rest of the budget with prompt chunks (arrival order)
            budget = args.n_batch - len(entries)
            for i, st in active.items():
                if budget <= 0:
                    break
                if st["last"] is not None:
                    continue
                toks = batch_reqs[i]["prompt_token_ids"]
                take = min(budget, len(toks) - st["fed"])
                for k in range(st["fed"], st["fed"] + take):
                    last = k == len(toks) - 1
                    entries.append((int(toks[k]), k, st["slot"], last))
                    if last:
                        owners.append((i, len(entries) - 1))
                st["fed"] += take
                budget -= take
            decode(entries)
            t_now = time.perf_counter()
            for i, row in owners:
                st = active[i]
                tok = argmax(row)
                if st["n"] == 0:
                    ttft[i] = t_now - t_start - arrive[i]
                st["n"] += 1
                st["last"] = tok
                out_ids[i].append(tok)
                if st["n"] >= int(batch_reqs[i]["max_tokens"]):
                    gen[i] = st["n"]
                    L.llama_memory_seq_rm(mem, st["slot"], -1, -1)
                    free_slots.append(st["slot"])
                    del active[i]
                    done += 1
        return gen, ttft, time.perf_counter() - t_start, out_ids

    # warm-up: two short requests through the same path (not timed)
    warm = [{"prompt_token_ids": r["prompt_token_ids"][:32], "max_tokens": 8, "arrival_s": 0.0} for r in reqs[:2]]
    run(warm, honour=False)
    load_s = time.perf_counter() - t0

    rounds = [run(reqs, honour=args.arrival == "honoured") for _ in range(max(1, args.repeat))]
    walls = [r[2] for r in rounds]
    gen, ttft, wall, out_ids = sorted(rounds, key=lambda r: r[2])[(len(rounds) - 1) // 2]

    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    generated = sum(gen)
    expected = sum(int(r["max_tokens"]) for r in reqs)
    result = {
        "engine": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "arrival": args.arrival,
        "batching": f"continuous (low-level llama_batch, n_seq_max={n_seq}, n_batch={args.n_batch})",
        "num_requests": len(reqs),
        "max_num_seqs": n_seq,
        "threads": threads,
        "gguf": str(gguf_path),
        "weights_type": args.outtype if not args.gguf else "as in --gguf",
        "kv_type": args.kv_type,
        "flash_attn": args.flash_attn,
        "n_ctx": cparams.n_ctx,
        "convert_s": convert_s,
        "load_s": load_s,
        "wall_s": wall,
        "wall_s_all": walls,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "expected_generated_tokens": expected,
        "gen_tok_s": generated / wall,
        "total_tok_s": (generated + prompt_tokens) / wall,
        "ttft_s": ttft,
        "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
    }
    if generated != expected:
        result["warning"] = f"generated {generated} tokens, expected {expected}"
    if args.save_tokens:
        result["output_token_ids"] = out_ids
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("ttft_s", "output_token_ids")}), file=sys.stderr)

    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
