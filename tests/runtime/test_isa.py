"""One answer to "what can this CPU do" (runtime/kernels/isa.py): WARMSTART_CPU_ISA lowers it and never raises it,
an unknown name is refused in one line, and every C extension runs at the level chosen."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.support.cli import WARMSTART
from tests.support.serving import REPO
from warmstart.handlers.errors import CPU_ISA_LEVELS
from warmstart.runtime.kernels import isa
from warmstart.runtime.models import weights
from warmstart.runtime.models.weights import prepack_in_background

EXTENSIONS = isa._extensions


def chosen_in_a_new_process(value: str) -> subprocess.CompletedProcess[str]:
    code = "from warmstart.runtime.kernels import isa; print(isa.chosen(), *[ext.isa() for ext in isa._extensions])"
    env = {**os.environ, isa.ISA_ENV: value}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def test_the_cli_knows_the_same_levels() -> None:
    assert CPU_ISA_LEVELS == isa.LEVELS


def test_every_extension_was_built_and_answers() -> None:
    assert len(EXTENSIONS) == 4  # a silent fallback to PyTorch would hide a kernel that failed to build
    assert {ext.best_isa() for ext in EXTENSIONS} == {isa.best()}


@pytest.mark.parametrize("value", isa.LEVELS)
def test_the_variable_lowers_and_never_raises(value: str) -> None:
    done = chosen_in_a_new_process(value)
    assert done.returncode == 0, done.stderr
    expected = min(isa.LEVELS.index(value), isa.LEVELS.index(isa.best()))
    assert done.stdout.split() == [isa.LEVELS[expected]] * (1 + len(EXTENSIONS))
    raised = isa.LEVELS.index(value) > isa.LEVELS.index(isa.best())
    assert (f"this CPU has at most {isa.best()}" in done.stderr) == raised


def test_an_unknown_level_is_refused_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, isa.ISA_ENV: "avx-512"}
    for command in (["serve", "nothing", "--store", str(tmp_path), "--port", "0"], ["build", str(tmp_path)]):
        done = subprocess.run([*WARMSTART, *command], capture_output=True, text=True,
                              cwd=REPO, env=env, timeout=120)  # fmt: skip
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip() == ("warmstart: error: WARMSTART_CPU_ISA='avx-512' is not an instruction set level: "
                                       "use one of portable, avx2, avx512, avx512_bf16 (it only lowers what this CPU "
                                       "runs), or unset it")  # fmt: skip


@pytest.mark.parametrize("level", isa.LEVELS[: isa.LEVELS.index(isa.best()) + 1])
def test_lowered_sets_every_extension_and_restores(level: str) -> None:
    before = isa.chosen()
    with isa.lowered(level):
        assert isa.chosen() == level and all(ext.isa() == level for ext in EXTENSIONS)
        assert isa.at_least("portable") and isa.at_least(level)
        assert all(not isa.at_least(higher) for higher in isa.LEVELS[isa.LEVELS.index(level) + 1 :])
    assert isa.chosen() == before and all(ext.isa() == before for ext in EXTENSIONS)


def test_lowered_refuses_what_the_cpu_lacks() -> None:
    with pytest.raises(ValueError, match="not a level this CPU has"):
        isa.lowered("avx3").__enter__()
    for ext in EXTENSIONS:
        with pytest.raises(ValueError, match="is not an instruction set this CPU has"):
            ext.isa("sse9")


def test_a_failed_prepack_logs_one_line_and_keeps_the_plain_weights(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """As oneDNN's refusal to pack bf16 on AVX2 once did, in the background thread: no traceback, the weights plain."""
    from warmstart.runtime import LLM

    llm = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16", num_kv_blocks=32, prepack_weights=False)
    model_weights = llm.engine.runner.model.weights

    def refuse(*_: object) -> None:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert\nmore")

    monkeypatch.setattr(weights, "PackedWeight", refuse)
    with caplog.at_level(logging.WARNING, logger="warmstart.runtime.models.weights"):
        prepack_in_background(model_weights).join()
    assert [r.getMessage() for r in caplog.records] == [
        "prepacking the weights failed, serving from the plain ones: mkldnn_reorder_linear_weight: bf16 path needs "
        "the cpu support avx_ne_convert"]
    assert "Traceback" not in capfd.readouterr().err
    assert all(isinstance(layer.qkv, torch.Tensor) for layer in model_weights.layers)
