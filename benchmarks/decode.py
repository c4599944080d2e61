"""Decode of one sequence on the CPU: warmstart against llama.cpp, side by side.

    OMP_NUM_THREADS=2 python -m benchmarks.decode [--rounds 5] [--systems warmstart warmstart-torch llamacpp]
        [--prompt-tokens 64] [--new-tokens 128] [--sequences 1] [--model-dir DIR] [--json OUT]
    OMP_NUM_THREADS=2 python -m benchmarks.decode --kernel-rows   # gemv kernel against oneDNN, rows 1..8

One sequence, greedy, EOS ignored, a fresh random prompt each round. Each generated token after the first is
timed (from the previous token to it; the prompt's prefill is not in it); a round's figure is the median of its
tokens (the mean is printed beside it: on a shared machine a descheduled thread makes a few tokens 10-100x slow),
and the summary takes the median over rounds. ``--sequences N`` decodes N sequences at once instead (fresh prompts
of the same length; each step timed; llama.cpp, which runs one, is left out). Systems, in an order that rotates
from round to round:
- ``warmstart``: the default CPU path in bfloat16: all decode layers in one C call (runtime/models/fused_decode.py)
  over the gemv kernel (runtime/kernels/cpu_gemv.c).
- ``warmstart-gemv``: the same engine with the layers on the ordinary ops, their decode linears on the gemv kernel
  (what ``WARMSTART_CPU_FUSED_DECODE=torch`` selects).
- ``warmstart-torch``: the same engine on its reference path (what ``WARMSTART_CPU_FUSED_DECODE=torch
  WARMSTART_CPU_GEMV=torch`` select: the ordinary ops, oneDNN on the prepacked weights).
- ``warmstart-4k``: the default path with the kernel's plain weights in a copy in ordinary 4 KiB pages rather than
  the huge pages prepacking puts them in (runtime/models/huge_pages.py).
  The four are switched in place, so they share one load.
- ``llamacpp``: llama.cpp (llama-cpp-python 0.3.36) on the same model converted to a bf16 GGUF (run_llamacpp.py's
  conversion cache), benchmarks/peers/decode_llamacpp.py under /work/peers/llamacpp/.venv (or
  $WARMSTART_LLAMACPP_PYTHON), one subprocess per round (its load is not timed); skipped when absent.
Each round also measures the memory read bandwidth (a bf16 sum over 256 MiB on the same threads) and states each
system's ms/token as a fraction of the floor: the bytes of weights one token reads (every layer's matrices and the
LM head) / that bandwidth. Medians over rounds, and the median of the per-round ratios to ``warmstart``.
The model: SmolLM2-135M-Instruct from `warmstart prepare-model smollm2`, in bfloat16 (--model-dir to override).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.kernels import cpu_gemv
from warmstart.runtime.layers.linear import plain_weight
from warmstart.runtime.models.weights import LINEAR_FIELDS, ModelWeights
from warmstart.runtime.quant.packed_linear import PackedWeight

REPO = Path(__file__).resolve().parent.parent
LLAMACPP_PYTHON = ("WARMSTART_LLAMACPP_PYTHON", Path("/work/peers/llamacpp/.venv/bin/python"))
SYSTEMS = ("warmstart", "warmstart-4k", "warmstart-gemv", "warmstart-torch", "llamacpp")


def weight_bytes_per_token(weights: ModelWeights) -> int:
    """Bytes of the matrices one decode step reads: each layer's linears and the LM head (the embedding row and
    the norms are noise)."""
    total = 0
    for layer in weights.layers:
        for name in LINEAR_FIELDS:
            w = plain_weight(getattr(layer, name))
            assert w is not None, "quantized weights: not this benchmark"
            total += w.numel() * w.element_size()
    head = plain_weight(weights.lm_head)
    assert head is not None
    return total + head.numel() * head.element_size()


def read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of a bf16 sum over ``nbytes`` on torch's threads (the best of ``repeats``)."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return nbytes / best


def _timed(f: Any) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


class Warmstart:
    """One engine, timed on its default path or with parts of it switched off (``set_path``)."""

    def __init__(self, model_dir: Path) -> None:
        self.llm = LLM.from_hf(model_dir, dtype="bfloat16")
        thread = self.llm.engine.prepack_thread
        if thread is not None:
            thread.join()
        self.model = self.llm.engine.runner.model
        self.default_gemv = bool(getattr(self.model.ops, "gemv_kernel", False))
        weights = self.model.weights
        self.packed = [w for w in [getattr(layer, f) for layer in weights.layers for f in LINEAR_FIELDS]
                       + [weights.lm_head] if isinstance(w, PackedWeight)]  # fmt: skip
        self.huge = [w.weight for w in self.packed]  # where prepacking put them
        self.small = [t.clone() for t in self.huge]  # torch's allocation: 4 KiB pages

    def set_path(self, system: str) -> None:
        self.model.ops.gemv_kernel = self.default_gemv and system != "warmstart-torch"  # type: ignore[attr-defined]
        if self.model.fused_decode is not None:
            self.model.fused_decode.enabled = system in ("warmstart", "warmstart-4k")
        for w, plain in zip(self.packed, self.small if system == "warmstart-4k" else self.huge, strict=True):
            w.weight = plain

    def token_ms(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """Each decode step after the first token: ms from the previous step's tokens to its (as served)."""
        engine = self.llm.engine
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True))
        times: list[float] = []
        produced: dict[str, int] = {}
        while engine.has_unfinished():
            advanced = False
            for out in engine.step():
                if len(out.token_ids) > produced.get(out.request_id, 0):
                    produced[out.request_id] = len(out.token_ids)
                    advanced = True
            if advanced:
                times.append(time.perf_counter())
        return [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]


def llamacpp_python() -> Path | None:
    path = Path(os.environ.get(LLAMACPP_PYTHON[0]) or LLAMACPP_PYTHON[1])
    return path if path.is_file() else None


def llamacpp_token_ms(python: Path, model_dir: Path, prompt: list[int], new_tokens: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        subprocess.run(
            [str(python), str(REPO / "benchmarks/peers/decode_llamacpp.py"), "--model-dir", str(model_dir),
             "--prompt", ",".join(map(str, prompt)), "--new-tokens", str(new_tokens), "--out", str(result)],
            check=True, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return list(json.loads(result.read_text())["token_ms"])


def run_rounds(args: argparse.Namespace) -> dict[str, Any]:
    systems = list(args.systems)
    python = llamacpp_python()
    if "llamacpp" in systems and args.sequences > 1:
        print("llamacpp: one sequence only; skipped", file=sys.stderr)
        systems.remove("llamacpp")
    if "llamacpp" in systems and python is None:
        print(f"llamacpp: no {LLAMACPP_PYTHON[1]} (set {LLAMACPP_PYTHON[0]}); skipped", file=sys.stderr)
        systems.remove("llamacpp")
    ours = Warmstart(args.model_dir)
    nbytes = weight_bytes_per_token(ours.llm.engine.runner.model.weights)
    for name in systems:  # warm-up, every path
        if name != "llamacpp":
            ours.set_path(name)
            ours.token_ms([[1, 2, 3]] * args.sequences, 8)
    rng = random.Random(0)
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_tokens)] for _ in range(args.sequences)]
        row: dict[str, float] = {"bandwidth_gb_s": read_bandwidth() / 1e9}
        for name in systems[r % len(systems):] + systems[: r % len(systems)]:
            if name == "llamacpp":
                assert python is not None
                token_ms = llamacpp_token_ms(python, args.model_dir, prompts[0], args.new_tokens)
            else:
                ours.set_path(name)
                token_ms = ours.token_ms(prompts, args.new_tokens)
            row[name] = harness.median(token_ms)
            row[name + " mean"] = statistics.fmean(token_ms)
        rounds.append(row)
        floor = nbytes / (row["bandwidth_gb_s"] * 1e9) * 1e3
        print(f"round {r} ({os.getloadavg()[0]:.2f} load): " + ", ".join(
            f"{s} {row[s]:.2f} ms/token (mean {row[s + ' mean']:.2f}; {floor / row[s]:.0%} of floor)" for s in systems
        ) + f"; bandwidth {row['bandwidth_gb_s']:.1f} GB/s, floor {floor:.2f} ms", flush=True)  # fmt: skip
    return summarize(systems, rounds, nbytes)


def summarize(systems: list[str], rounds: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    bandwidth = harness.median(r["bandwidth_gb_s"] for r in rounds)
    floor = nbytes / (bandwidth * 1e9) * 1e3
    summary: dict[str, Any] = {"weight_mb_per_token": nbytes / 1e6, "bandwidth_gb_s": bandwidth, "floor_ms": floor,
                               "rounds": rounds, "systems": {}}  # fmt: skip
    print(f"\nweights per token {nbytes / 1e6:.0f} MB; bandwidth (median) {bandwidth:.1f} GB/s; floor {floor:.2f} ms")
    for s in systems:
        ms = harness.median(r[s] for r in rounds)
        mean = harness.median(r[s + " mean"] for r in rounds)
        ratios = [r[s] / r["warmstart"] for r in rounds] if "warmstart" in systems else []
        summary["systems"][s] = {"ms_per_token": ms, "mean_ms_per_token": mean, "fraction_of_floor": floor / ms,
                                 "per_round_ratio": ratios}
        vs = f"; ms/token vs warmstart per round {', '.join(f'{x:.2f}' for x in ratios)}" if s != "warmstart" else ""
        print(f"{s}: {ms:.2f} ms/token (mean {mean:.2f}), {floor / ms:.0%} of the bandwidth floor{vs}"
              + (f" (median {harness.median(ratios):.2f}x)" if ratios and s != "warmstart" else ""))
    return summary


def kernel_rows(args: argparse.Namespace, rounds: int = 7) -> None:
    """Every linear of the model once per pass (as a decode step reads them), on the gemv kernel and on oneDNN's
    prepacked weights, for 1..KERNEL_MAX_ROWS rows: what chose cpu_gemv.MAX_ROWS."""
    llm = LLM.from_hf(args.model_dir, dtype="bfloat16")
    weights = llm.engine.runner.model.weights
    if llm.engine.prepack_thread is not None:
        llm.engine.prepack_thread.join()
    packed = [getattr(layer, f) for layer in weights.layers for f in LINEAR_FIELDS] + [weights.lm_head]
    packed = [w if isinstance(w, PackedWeight) else PackedWeight(w) for w in packed]
    for rows in range(1, cpu_gemv.KERNEL_MAX_ROWS + 1):
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {w.shape[1] for w in packed}}
        on_gemv = functools.partial(_pass_over, packed, xs, True)
        on_onednn = functools.partial(_pass_over, packed, xs, False)
        times: dict[str, list[float]] = {"gemv": [], "onednn": []}
        for _ in range(rounds):
            times["gemv"].append(_timed(on_gemv))
            times["onednn"].append(_timed(on_onednn))
        ratios = [o / g for g, o in zip(times["gemv"], times["onednn"], strict=True)]
        print(f"rows {rows}: gemv {harness.median(times['gemv']) * 1e3:.2f} ms, oneDNN "
              f"{harness.median(times['onednn']) * 1e3:.2f} ms per pass over the weights; oneDNN/gemv per round "
              f"median {harness.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})", flush=True)


def _pass_over(packed: list[PackedWeight], xs: dict[int, torch.Tensor], gemv: bool) -> None:
    for w in packed:
        if gemv:
            cpu_gemv.gemv(xs[w.shape[1]], w.weight)
        else:
            w.linear(xs[w.shape[1]])


def main() -> int:
    p = harness.arguments(__doc__, rounds=5)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--sequences", type=int, default=1, help="decode this many sequences at once (ms per step)")
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/warmstart/models/smollm2")
    p.add_argument("--kernel-rows", action="store_true", help="only the gemv kernel against oneDNN, rows 1..8")
    args = harness.parse(p)
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"{args.model_dir}: no model there; run `warmstart prepare-model smollm2` or pass --model-dir")
    if args.kernel_rows:
        kernel_rows(args)
        return 0
    if "warmstart" not in args.systems:
        raise SystemExit("--systems must include warmstart (the ratios are to it)")
    harness.report(args, run_rounds(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
