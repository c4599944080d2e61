"""One sequence's decode on llama.cpp, each token timed: the peer side of benchmarks/decode.py.

    OMP_NUM_THREADS=2 /work/peers/llamacpp/.venv/bin/python decode_llamacpp.py --model-dir DIR \
        --prompt 1,2,3 --new-tokens 128 --out result.json [--outtype bf16|f16|f32|q8_0|q4_0]

The GGUF comes from run_llamacpp.py's conversion cache (bf16 by default, converted once with llama.cpp's own
converter; q8_0/q4_0 quantized from the f32 one with llama_model_quantize).
The prompt goes in as one llama_decode; then each step decodes the last token alone and takes the argmax of its
logits (greedy, EOS ignored), as run_llamacpp.py does for one sequence. Output JSON: token_ms (each generated
token after the first: the time from the previous token to it), first_token_s, token_ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from run_llamacpp import OUTTYPES, _gguf_for  # run as a file, so its folder is on the path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--prompt", required=True, help="token ids, comma-separated")
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--outtype", default="bf16", choices=OUTTYPES, help="the GGUF's weight type (default bf16)")
    args = p.parse_args()
    conversion = argparse.Namespace(model_dir=args.model_dir, gguf=None, outtype=args.outtype,
                                    gguf_cache=os.environ.get("LLAMACPP_GGUF_CACHE")
                                    or str(Path(sys.prefix).resolve().parent / "gguf-cache"))
    gguf, _ = _gguf_for(conversion)

    import llama_cpp.llama_cpp as L
    import numpy as np

    @L.ctypes.CFUNCTYPE(None, L.ctypes.c_int, L.ctypes.c_char_p, L.ctypes.c_void_p)
    def quiet(level, text, user_data):  # type: ignore[no-untyped-def]
        pass

    L.llama_log_set(quiet, None)
    prompt = [int(t) for t in args.prompt.split(",")]
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or (os.cpu_count() or 1)
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(gguf).encode(), mparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cparams = L.llama_context_default_params()
    cparams.n_ctx = (len(prompt) + args.new_tokens + 256) // 256 * 256
    cparams.n_batch = cparams.n_ubatch = max(512, len(prompt))
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.no_perf = True
    ctx = L.llama_init_from_model(model, cparams)
    batch = L.llama_batch_init(cparams.n_batch, 0, 1)

    def decode(tokens: list[int], start: int) -> int:
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(n_vocab,))
        return int(np.argmax(logits))

    decode(prompt[:8], 0)  # warm-up
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    start = time.perf_counter()
    token_ids = [decode(prompt, 0)]
    first = last = time.perf_counter()
    token_ms = []
    for step in range(args.new_tokens):
        token_ids.append(decode([token_ids[-1]], len(prompt) + step))
        now = time.perf_counter()
        token_ms.append((now - last) * 1e3)
        last = now
    Path(args.out).write_text(json.dumps({"token_ms": token_ms, "first_token_s": first - start,
                                          "token_ids": token_ids, "threads": threads, "gguf": str(gguf)}))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
