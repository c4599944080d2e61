"""Issue 34, item 4: vLLM's flags as a user coming from `vllm serve` types them: taken where they mean the same
here, refused naming the command that takes them otherwise, and `warmstart --version`."""

from __future__ import annotations

import re
import subprocess
from importlib.metadata import version

import pytest

from tests.support.cli import WARMSTART
from tests.support.serving import REPO
from warmstart.handlers.cli.main import build_parser
from warmstart.handlers.cli.vllm_flags import snapshot_ref
from warmstart.handlers.errors import CliError
from warmstart.runtime.engine.options import EngineOptions


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


def test_vllms_names_mean_ours() -> None:
    args = parse("--model", "chat", "--tensor-parallel-size", "2", "--enable-lora")
    snapshot_ref(args)
    assert (args.ref, args.tensor_parallel, args.enable_lora) == ("chat", 2, True)
    plain = parse("chat")
    snapshot_ref(plain)
    assert (plain.ref, plain.tensor_parallel) == ("chat", 1)


@pytest.mark.parametrize(("argv", "says"), [
    ((), "name the snapshot to serve"),
    (("a", "--model", "b"), "name two snapshots"),
])  # fmt: skip
def test_one_snapshot_is_named(argv: tuple[str, ...], says: str) -> None:
    with pytest.raises(CliError, match=says):
        snapshot_ref(parse(*argv))


@pytest.mark.parametrize(("flag", "says"), [
    ("--dtype", "serve does not take --dtype (vLLM's serve does): the snapshot fixes the dtype: give `warmstart build"),
    ("--quantization", "serve does not take --quantization (vLLM's serve does): the snapshot fixes the weights' "
                       "format: give `warmstart build MODEL_DIR --quant"),
])  # fmt: skip
def test_flags_of_the_build_step_say_where_they_go(flag: str, says: str) -> None:
    done = subprocess.run([*WARMSTART, "serve", "chat", flag, "bfloat16"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)  # fmt: skip
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_version() -> None:
    done = subprocess.run([*WARMSTART, "--version"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, f"warmstart {version('warmstart')}")



def test_the_engine_flags_show_the_engine_s_own_defaults(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """One place for the defaults (EngineOptions): the help says what an engine started without the flag gets,
    whatever that is."""
    shown = {"max_num_seqs": 77, "max_num_batched_tokens": 3001, "max_loras": 5, "max_lora_rank": 33,
             "num_speculative_tokens": 6}
    for name, value in shown.items():
        monkeypatch.setattr(EngineOptions, name, value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, value in shown.items():
        flag = "--" + name.replace("_", "-")
        assert re.search(rf"{flag} \S+ [^-]*\(default {value}\)", text), flag
