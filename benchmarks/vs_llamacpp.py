"""warmstart against llama.cpp on this machine, side by side: prefill, batch-1 decode, ratios, the ISA.

    OMP_NUM_THREADS=2 python -m benchmarks.vs_llamacpp [--isa native|avx2] [--rounds 3] [--model-dir DIR]
        [--new-tokens 128] [--json OUT]

Prints the CPU's vector flags (/proc/cpuinfo), the instruction set our kernels have and run at
(runtime.kernels.isa best/chosen, and torch's ATen capability), and llama.cpp's llama_print_system_info; then:
- prefill: 8 cold prompts of 384 random token ids (fresh each round; one token generated), prompt tok/s. Ours in
  bfloat16 (the worker of benchmarks/prefill.py); llama.cpp in f16, bf16 and f32 GGUFs (benchmarks/peers/
  run_llamacpp.py, 8 slots, burst), and its best of the three.
- decode: one sequence, a 64-token prompt, --new-tokens greedy tokens, ms/token (median of a run's tokens, as
  benchmarks/decode.py times them): our bf16 against llama.cpp's f16 and bf16, our int8 against q8_0, our int4
  (group 128) against q4_0 (benchmarks/peers/decode_llamacpp.py). The weights' MB are printed beside: a GGUF's
  file size; ours, the engine's weight tensors (the head stays bf16 in int8/int4; llama.cpp's q4_0 makes the tied
  head/embedding q8_0).
Each round runs every measurement once, ours and llama.cpp's interleaved in an order that rotates from round to
round, so that load on a shared machine hits both; medians over rounds, and the median of the per-round ratios
("x faster": ours' speed over llama.cpp's; above 1 we are faster).

--isa native (default): both as built for this CPU: our engine as it chooses, llama.cpp from
/work/peers/llamacpp/.venv (GGML_NATIVE). --isa avx2 emulates an AVX2-only machine on an AVX-512 one: our engine
runs under WARMSTART_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 (our kernels, oneDNN and ATen
all held to AVX2), llama.cpp from /work/peers/llamacpp-avx2/.venv (built with AVX512 off; benchmarks/peers/
README.md). --llamacpp-python overrides the peer's python. GGUFs are converted once into $LLAMACPP_GGUF_CACHE
(default /work/peers/llamacpp/gguf-cache, shared by both builds). Both run on $OMP_NUM_THREADS threads (default 2).
The model: SmolLM2-135M-Instruct from `warmstart prepare-model smollm2` (that package ships a Q4_1 GGUF, so the
weights are the Q4_1 checkpoint dequantized).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.prefill import Worker, default_model_dir

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / "benchmarks" / "peers"
LLAMACPP = {"native": Path("/work/peers/llamacpp/.venv/bin/python"),
            "avx2": Path("/work/peers/llamacpp-avx2/.venv/bin/python")}
GGUF_CACHE = Path("/work/peers/llamacpp/gguf-cache")
AVX2_ENV = {"WARMSTART_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_ne_convert")
PREFILL_PEER = ("f16", "bf16", "f32")
DECODE = [("bf16", "f16"), ("bf16", "bf16"), ("int8", "q8_0"), ("int4", "q4_0")]  # (ours, llama.cpp's)
PROMPTS, PROMPT_LEN, DECODE_PROMPT = 8, 384, 64


# -- our decode worker (this file with --worker, in the environment of --isa) --------------------------------


def decode_worker(model_dir: Path) -> None:
    import torch

    from benchmarks.decode import Warmstart
    from warmstart.runtime import LLM, EngineOptions, LLMEngine
    from warmstart.runtime.kernels import isa
    from warmstart.runtime.models.config import ModelConfig
    from warmstart.runtime.models.quantize import quantize_model
    from warmstart.runtime.models.weights import load_weights

    class Ours(Warmstart):  # decode.py's timing (token_ms) over an engine of any weight format
        def __init__(self, scheme: str) -> None:
            config = ModelConfig.from_dir(model_dir)
            weights = quantize_model(load_weights(model_dir, config, torch.bfloat16), scheme)
            self.mb = sum(t.nbytes for t in weights.tensors().values()) / 1e6
            options = EngineOptions(dtype="bfloat16", max_num_seqs=4, num_kv_blocks=64)
            self.llm = LLM(LLMEngine.from_weights(config, weights, None, options))
            if self.llm.engine.prepack_thread is not None:
                self.llm.engine.prepack_thread.join()
            self.token_ms([[1, 2, 3]], 8)  # warm-up

    engines = {"bf16": Ours("none"), "int8": Ours("int8"), "int4": Ours("int4")}
    print(json.dumps({"ready": True, "isa_best": isa.best(), "isa_chosen": isa.chosen(), "torch": torch.__version__,
                      "aten_capability": torch.backends.cpu.get_cpu_capability(),
                      "mb": {k: e.mb for k, e in engines.items()}}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        ms = engines[job["format"]].token_ms([job["prompt"]], job["new_tokens"])
        print(json.dumps({"ms": harness.median(ms)}), flush=True)


# -- the driver -----------------------------------------------------------------------------------------------


def cpu_line() -> str:
    _, flags = harness.cpu_flags(Path("/proc/cpuinfo").read_text())
    lacks = " ".join(f for f in FLAGS if f not in flags)
    return f"{' '.join(f for f in FLAGS if f in flags)}; lacks: {lacks}"


def peer(python: Path, env: dict[str, str], script: str, *args: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "out.json", Path(tmp) / "log"
        with log.open("w") as f:
            done = subprocess.run([str(python), str(PEERS / script), *args, "--out", str(out)], env=env, stderr=f,
                                  stdout=f, cwd=PEERS)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"llama.cpp {script} failed ({done.returncode}):\n{log.read_text()[-3000:]}")
        return dict(json.loads(out.read_text()))


def llama_prefill(python: Path, env: dict[str, str], model: Path, prompts: list[list[int]], outtype: str) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump([{"prompt_token_ids": p, "max_tokens": 1, "arrival_s": 0.0} for p in prompts], f)
        f.flush()
        r = peer(python, env, "run_llamacpp.py", "--model-dir", str(model), "--requests", f.name, "--outtype", outtype,
                 "--arrival", "burst", "--max-num-seqs", str(len(prompts)))  # fmt: skip
    return float(r["prompt_tokens"] / r["wall_s"])


def llama_decode(python: Path, env: dict[str, str], model: Path, prompt: list[int], n: int, outtype: str) -> dict:
    r = peer(python, env, "decode_llamacpp.py", "--model-dir", str(model), "--prompt", ",".join(map(str, prompt)),
             "--new-tokens", str(n), "--outtype", outtype)  # fmt: skip
    return {"ms": harness.median(r["token_ms"]), "mb": os.path.getsize(r["gguf"]) / 1e6}


def main() -> int:
    p = harness.arguments(__doc__, rounds=3)
    p.add_argument("--isa", choices=("native", "avx2"), default="native")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--llamacpp-python", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = harness.parse(p)
    if args.worker:
        decode_worker(args.model_dir)
        return 0
    model = args.model_dir or default_model_dir()
    base = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    ours_env = {**base, **(AVX2_ENV if args.isa == "avx2" else {})}
    llama_env = {**base, "LLAMACPP_GGUF_CACHE": os.environ.get("LLAMACPP_GGUF_CACHE", str(GGUF_CACHE))}
    python = args.llamacpp_python or LLAMACPP[args.isa]
    if not python.is_file():
        raise SystemExit(f"no llama.cpp venv at {python}: see benchmarks/peers/README.md")

    print(f"vector flags: {cpu_line()}")
    print(f"mode: --isa {args.isa}" + (f" (ours under {' '.join(f'{k}={v}' for k, v in AVX2_ENV.items())})"
                                       if args.isa == "avx2" else "") + f"; OMP_NUM_THREADS={base['OMP_NUM_THREADS']}")
    sysinfo = subprocess.run([str(python), "-c", "import llama_cpp as l; print(l.__version__, "
                              "l.llama_print_system_info().decode().strip())"], env=llama_env, capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    print(f"llama.cpp ({python}): llama-cpp-python {sysinfo}", flush=True)
    prefill = Worker("prefill", harness.module_command("benchmarks.prefill", "--worker", "--model-dir", str(model),
                                                       "--max-num-batched-tokens", "2048"), ours_env)  # fmt: skip
    decode = Worker("decode", harness.module_command("benchmarks.vs_llamacpp", "--worker", "--model-dir", str(model)),
                    ours_env)
    if not (prefill.wait_ready() and decode.wait_ready()):
        return 1
    info = decode.info
    warm = random.Random("vs-llamacpp-warm-up")
    prefill.run({"prefix": None, "prompts": [[warm.randrange(100, 49000) for _ in range(PROMPT_LEN)]] * 2})
    print(f"warmstart: kernels best {info['isa_best']}, chosen {info['isa_chosen']}; torch {info['torch']} ATen "
          f"capability {info['aten_capability']}; model {model}\n", flush=True)

    rounds: list[dict[str, float]] = []
    mb: dict[str, float] = {f"ours {k}": v for k, v in info["mb"].items()}
    try:
        for r in range(args.rounds):
            rng = random.Random(f"vs-llamacpp-{r}")
            prompts = [[rng.randrange(100, 49000) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
            prompt = [rng.randrange(100, 49000) for _ in range(DECODE_PROMPT)]
            row: dict[str, float] = {}
            units = [("prefill", "ours bf16")] + [("prefill", f"llama {t}") for t in PREFILL_PEER]
            units += [("decode", f"ours {o}") for o in ("bf16", "int8", "int4")]
            units += [("decode", f"llama {t}") for _, t in DECODE]
            k = r % len(units)
            for kind, name in units[k:] + units[:k]:
                who, fmt = name.split()
                if kind == "prefill" and who == "ours":
                    reply = prefill.run({"prefix": None, "prompts": prompts})
                    if reply["cached_tokens"]:
                        print(f"warning: {reply['cached_tokens']} prompt tokens came from the cache", file=sys.stderr)
                    row[f"prefill {name}"] = PROMPTS * PROMPT_LEN / reply["wall_s"]
                elif kind == "prefill":
                    row[f"prefill {name}"] = llama_prefill(python, llama_env, model, prompts, fmt)
                elif who == "ours":
                    row[f"decode {name}"] = decode.run({"format": fmt, "prompt": prompt,
                                                        "new_tokens": args.new_tokens})["ms"]
                else:
                    d = llama_decode(python, llama_env, model, prompt, args.new_tokens, fmt)
                    row[f"decode {name}"], mb[name] = d["ms"], d["mb"]
            rounds.append(row)
            print(f"round {r} (load {os.getloadavg()[0]:.1f}): " + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
                  + "  (prefill tok/s, decode ms/token)", flush=True)  # fmt: skip
    finally:
        for w in (prefill, decode):
            w.close()
    report(rounds, mb)
    harness.report(args, {"isa": args.isa, "rounds": rounds, "mb": mb, "ours": info, "llamacpp": sysinfo})
    return 0


def report(rounds: list[dict[str, float]], mb: dict[str, float]) -> None:
    def med(key: str) -> float:
        return harness.median(r[key] for r in rounds)

    def line(what: str, ours: str, theirs: str, faster: list[float], unit: str) -> None:
        per = ", ".join(f"{x:.2f}" for x in faster)
        mine, peer = [r[ours] for r in rounds], [r[theirs] for r in rounds]  # each side's quietest round:
        quiet = min(peer) / min(mine) if unit == "ms/token" else max(mine) / max(peer)
        print(f"| {what} | {med(ours):,.1f} | {med(theirs):,.1f} | {harness.median(faster):.2f}x ({per}) | "
              f"{quiet:.2f}x | {unit} |")

    print(f"\n{len(rounds)} rounds; medians; 'x faster' = ours' speed / llama.cpp's, the median of the per-round "
          "ratios; 'best/best' = the ratio of each side's fastest round")
    print("| compared | warmstart | llama.cpp | x faster (per round) | best/best | unit |\n|---|---|---|---|---|---|")
    best = max(PREFILL_PEER, key=lambda t: med(f"prefill llama {t}"))
    for t in PREFILL_PEER:
        key = f"prefill llama {t}"
        line(f"prefill {PROMPTS}x{PROMPT_LEN}: ours bf16 vs {t}" + (" (llama.cpp's best)" if t == best else ""),
             "prefill ours bf16", key, [r["prefill ours bf16"] / r[key] for r in rounds], "prompt tok/s")
    for o, t in DECODE:
        ours, theirs = f"decode ours {o}", f"decode llama {t}"
        line(f"decode batch 1: ours {o} ({mb[f'ours {o}']:.0f} MB) vs {t} ({mb[f'llama {t}']:.0f} MB)", ours, theirs,
             [r[theirs] / r[ours] for r in rounds], "ms/token")


if __name__ == "__main__":
    sys.exit(main())
