"""What every benchmark here shares: its common arguments, the line that says which machine ran it, timing with a
warm-up, medians, and the side-by-side ratio.

A script is run as a module from the repository root (``python -m benchmarks.decode``), so that it imports its
siblings as ``benchmarks.x`` and the engine as the installed ``warmstart`` package, without editing sys.path:

    ap = harness.arguments(__doc__, rounds=5, warmup=1)  # --rounds, --warmup, --json OUT
    ap.add_argument("--prompt-tokens", type=int, default=64)
    args = harness.parse(ap)                      # prints the machine line
    times = harness.alternate({"ours": run_ours, "theirs": run_theirs}, args.rounds, args.warmup)
    ratio = harness.ratio(times["theirs"], times["ours"])  # theirs/ours seconds: > 1 where ours is ahead
    harness.report(args, {"seconds": harness.medians(times), "ratio": ratio}, lines)

Systems are alternated within each round (the order rotating from round to round) so that load from the rest of
a shared machine spreads over all of them; a ratio is taken per round, then its median, never as the ratio of two
medians from different moments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# the vector extensions that decide which kernels a CPU runs, best first
ISA_FLAGS = (("avx512_bf16", ("avx512f", "avx512bw", "avx512_bf16")), ("avx512", ("avx512f", "avx512bw")),
             ("avx2", ("avx2", "fma")), ("avx", ("avx",)), ("sse4.2", ("sse4_2",)))


def arguments(doc: str | None, *, rounds: int | None = 3, warmup: int | None = None,
              json_out: bool = True) -> argparse.ArgumentParser:
    """A parser whose help is the script's docstring, with the options every benchmark takes: --rounds, --warmup
    and --json where the script has them (a default of None or False leaves one out: a script of fresh processes,
    each cold, has no warm-up; one that writes its own report files has no --json)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds,
                        help=f"measured rounds, each system once per round (default {rounds})")
    if warmup is not None:
        ap.add_argument("--warmup", type=int, default=warmup,
                        help=f"untimed rounds or calls before measuring (default {warmup})")
    if json_out:
        ap.add_argument("--json", type=Path, metavar="OUT", help="also write the results, with the machine, to OUT")
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the arguments and say which machine runs the benchmark. A script's own worker process (--worker) says
    nothing: asking the machine imports torch, which the worker may be timing."""
    args = ap.parse_args(argv)
    if getattr(args, "rounds", 1) < 1:
        ap.error("--rounds must be at least 1")
    if not getattr(args, "worker", None):
        print(machine_line(), flush=True)
    return args


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs benchmarks' ``module`` in a child process of this interpreter: run it with
    ``cwd=harness.REPO``, where ``benchmarks`` is importable."""
    return [sys.executable, "-m", module, *args]


def cpu_flags(cpuinfo: str) -> tuple[str, set[str]]:
    """The CPU's model name and vector flags from the text of /proc/cpuinfo."""
    lines = cpuinfo.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith(("flags", "Features"))), [])
    return model, set(flags)


def isa(flags: set[str]) -> str:
    """The best vector extension of ISA_FLAGS that the flags show, else the machine's architecture."""
    return next((name for name, needs in ISA_FLAGS if flags.issuperset(needs)), platform.machine())


def machine() -> dict[str, Any]:
    """Which machine, which software: everything a figure is only comparable within (imports torch to ask it)."""
    try:
        model, flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = platform.processor() or platform.machine(), set()
    out: dict[str, Any] = {"cpu": model, "isa": isa(flags), "cpus": len(os.sched_getaffinity(0)),
                           "python": platform.python_version(), "date": datetime.datetime.now(datetime.UTC)
                           .strftime("%Y-%m-%d %H:%M UTC")}
    for package in ("torch", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[package] = importlib.metadata.version(package)
    with contextlib.suppress(ImportError):
        import torch

        out["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
    with contextlib.suppress(ImportError):
        from warmstart.runtime.kernels import isa as kernels

        out["kernels"] = kernels.chosen()
    return out


def machine_line(info: Mapping[str, Any] | None = None) -> str:
    m = dict(info or machine())
    parts = [f"{m['cpu']}, {m['cpus']} CPUs, {m['isa']}"]
    parts += [f"{key} {m[key]}" for key in ("threads", "kernels", "gpu", "torch", "transformers") if key in m]
    return "machine: " + "; ".join(parts) + f"; Python {m['python']}; {m['date']}"


def seconds(call: Callable[[], Any]) -> float:
    """The wall time of one call."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def timed(call: Callable[[], Any], rounds: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``rounds`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    return [seconds(call) for _ in range(rounds)]


def alternate(systems: Mapping[str, Callable[[], float]], rounds: int, warmup: int = 0) -> dict[str, list[float]]:
    """Each system's figure per round: every round runs every system once, the order rotating by one per round.
    A system's callable returns its figure (seconds, tokens/s, ...); wrap a plain call in ``seconds``. The warm-up
    rounds run the same way and are dropped."""
    names = list(systems)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            value = systems[name]()
            if r >= warmup:
                out[name].append(value)
    return out


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def medians(per_round: Mapping[str, Iterable[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in per_round.items()}


def ratio(numerators: Iterable[float], denominators: Iterable[float]) -> dict[str, Any]:
    """The ratio in each round and their median: pass the figures so that > 1 means ours is ahead (theirs/ours for
    times, ours/theirs for rates)."""
    per_round = [a / b for a, b in zip(numerators, denominators, strict=True)]
    return {"median": statistics.median(per_round), "per_round": per_round}


def ratio_text(r: Mapping[str, Any]) -> str:
    return f"{r['median']:.2f}x (per round {', '.join(f'{x:.2f}' for x in r['per_round'])})"


def report(args: argparse.Namespace, result: Mapping[str, Any], lines: Iterable[str] = ()) -> None:
    """Print the table's lines; where --json names a file, write the result there with the machine."""
    for line in lines:
        print(line, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine(), **result}, indent=1, default=str) + "\n")
        print(f"wrote {args.json}", flush=True)
