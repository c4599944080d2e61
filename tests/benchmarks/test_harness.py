"""benchmarks/harness.py: the machine line, alternation, per-round ratios and the JSON report; and that every
benchmark script takes its arguments from it, runs as a module and edits no sys.path."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
# llama.cpp's converter is a program of its own tree, which it imports from (gguf-py); that peer shim loads it so
FOREIGN_PATHS = {BENCHMARKS / "peers" / "llamacpp_convert.py"}

AVX512_BF16 = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16
"""
AVX2 = "model name\t: AMD EPYC 7R13\nflags\t\t: fpu sse4_2 avx avx2 fma f16c\n"


def test_the_isa_is_the_best_extension_the_flags_show() -> None:
    assert harness.cpu_flags(AVX512_BF16)[0] == "AMD EPYC 9R14"
    assert harness.isa(harness.cpu_flags(AVX512_BF16)[1]) == "avx512_bf16"
    assert harness.isa(harness.cpu_flags(AVX2)[1]) == "avx2"
    assert harness.isa(harness.cpu_flags(AVX512_BF16.replace(" avx512_bf16", ""))[1]) == "avx512"
    assert harness.isa({"sse4_2", "avx"}) == "avx"


def test_the_machine_line_names_the_cpu_its_isa_and_the_software() -> None:
    info = harness.machine()
    assert info["cpus"] >= 1 and info["isa"] and info["torch"]
    line = harness.machine_line(info)
    assert line.startswith(f"machine: {info['cpu']}, {info['cpus']} CPUs, {info['isa']}")
    assert f"torch {info['torch']}" in line and info["date"] in line


def test_systems_alternate_in_a_rotating_order_and_warm_up_rounds_are_dropped() -> None:
    calls: list[str] = []

    def system(name: str, value: float):  # type: ignore[no-untyped-def]
        def run() -> float:
            calls.append(name)
            return value + len(calls)

        return run

    out = harness.alternate({"a": system("a", 0), "b": system("b", 100), "c": system("c", 200)}, rounds=2, warmup=1)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert out == {"a": [6, 8], "b": [104, 109], "c": [205, 207]}


def test_a_ratio_is_taken_per_round_then_its_median() -> None:
    r = harness.ratio([2.0, 9.0, 4.0], [1.0, 3.0, 1.0])
    assert r == {"median": 3.0, "per_round": [2.0, 3.0, 4.0]}
    assert harness.ratio_text(r) == "3.00x (per round 2.00, 3.00, 4.00)"
    with pytest.raises(ValueError):
        harness.ratio([1.0, 2.0], [1.0])


def test_timed_runs_the_warm_up_untimed() -> None:
    calls = []
    times = harness.timed(lambda: calls.append(1), rounds=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def test_arguments_parse_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ap = harness.arguments("what it measures", rounds=4, warmup=1)
    args = harness.parse(ap, ["--json", str(tmp_path / "out.json")])
    assert (args.rounds, args.warmup) == (4, 1)
    harness.report(args, {"ratio": harness.ratio([2.0], [1.0])}, ["the table"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("machine: ") and printed[1] == "the table"
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["ratio"]["median"] == 2.0 and written["machine"]["cpus"] >= 1
    with pytest.raises(SystemExit):
        harness.parse(ap, ["--rounds", "0"])
    bare = harness.arguments(None, rounds=None, json_out=False).parse_args([])
    assert vars(bare) == {}


def test_a_worker_process_prints_no_machine_line(capsys: pytest.CaptureFixture[str]) -> None:
    ap = harness.arguments(None, rounds=None)
    ap.add_argument("--worker", action="store_true")
    harness.parse(ap, ["--worker"])
    assert capsys.readouterr().out == ""


SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if "def main(" in p.read_text())


def test_no_benchmark_edits_sys_path() -> None:
    editing = [str(p.relative_to(ROOT)) for p in BENCHMARKS.rglob("*.py")
               if p not in FOREIGN_PATHS and re.search(r"sys\.path\.(insert|append)|sys\.path\s*=", p.read_text())]
    assert not editing, f"run these as modules (python -m benchmarks.NAME) instead: {editing}"


def test_every_script_takes_its_arguments_from_the_harness() -> None:
    """Each script's --help, run as a module in one child process (an import of gpu_check sets Triton's
    interpreter in the environment): the options the harness adds are there, the usage names the module."""
    names = [p.stem for p in SCRIPTS]
    assert {"decode", "prefill", "cold_start", "vs_llamacpp", "gpu_check"} <= set(names)
    probe = """
import contextlib, importlib, io, json, sys
out = {}
for name in sys.argv[1:]:
    module = importlib.import_module("benchmarks." + name)
    sys.argv = ["python -m benchmarks." + name, "--help"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        module.main()
    out[name] = text.getvalue()
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", probe, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    helps = json.loads(done.stdout.splitlines()[-1])
    for name, text in helps.items():
        assert text.startswith(f"usage: python -m benchmarks.{name}"), (name, text[:200])
        assert "--json OUT" in text or name == "gpu_check", name
    assert all("--rounds ROUNDS" in helps[name] for name in ("decode", "prefill", "prefix", "adapters", "lora"))


def test_a_script_runs_as_a_module_and_writes_its_json(tmp_path: Path) -> None:
    """One real benchmark, at toy size: the KV write and prefill attention alone (no model to build)."""
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.prefill_attention", "--rounds", "1", "--warmup", "0",
                           "--dtype", "float32", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("machine: ")
    result = json.loads(out.read_text())
    assert set(result["attention"]) == {"short", "cached", "long"}
    assert all(len(r["sdpa_over_kernel"]["per_round"]) == 1 for r in result["attention"].values())


def test_the_json_option_reads_a_path() -> None:
    args = harness.arguments(None).parse_args(["--json", "x.json"])
    assert isinstance(args, argparse.Namespace) and args.json == Path("x.json") and "warmup" not in vars(args)
