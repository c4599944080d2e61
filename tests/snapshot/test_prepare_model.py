"""`warmstart prepare-model`: a GGUF checkpoint becomes an HF directory that the engine serves like transformers.

Offline: the GGUF is a tiny Llama written here with the `gguf` package (the real one is downloaded only by the
command itself), and the conversion runs through the same code path as the download.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.cli import WARMSTART
from tests.support.reference import assert_matches_reference
from warmstart.snapshot.prepare_model import READY_MARK, PrepareError, prepare_model

pytest.importorskip("gguf", reason="the `gguf` package (test extra) writes the tiny checkpoint")

from tests.support.gguf_model import write_tiny_llama_gguf  # noqa: E402  (after the skip: it imports gguf)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    return path


def test_converted_gguf_serves_like_transformers(tiny_gguf: Path, tmp_path: Path) -> None:
    from warmstart.runtime import LLM, SamplingParams

    model_dir = prepare_model("smollm2", tmp_path / "smollm2", gguf_file=tiny_gguf)
    import json

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / READY_MARK).is_file()
    prompt = [5, 70, 33, 200, 17, 90, 3]
    llm = LLM.from_hf(model_dir, dtype="float32")
    ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    assert_matches_reference(model_dir, prompt, ours, 12)
    assert llm.tokenizer.decode(llm.tokenizer.encode("hello")) == "hello"


def test_prepared_model_is_not_converted_again(tiny_gguf: Path, tmp_path: Path) -> None:
    model_dir = prepare_model("smollm2", tmp_path / "m", gguf_file=tiny_gguf)
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_model("smollm2", tmp_path / "m", gguf_file=tmp_path / "absent.gguf") == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_interrupted_conversion_is_redone(tiny_gguf: Path, tmp_path: Path) -> None:
    half = tmp_path / "m"
    half.mkdir()
    (half / "config.json").write_text("{")  # what a killed conversion may leave: no READY_MARK
    model_dir = prepare_model("smollm2", half, gguf_file=tiny_gguf)
    assert (model_dir / READY_MARK).is_file() and (model_dir / "model.safetensors").is_file()


def test_unreadable_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(PrepareError, match="cannot read"):
        prepare_model("smollm2", tmp_path / "m", gguf_file=bad)
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]  # no temporary directory left behind


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match="unknown model 'nope'; known: smollm2"):
        prepare_model("nope", tmp_path / "m")


def test_cli_prints_the_directory_and_reports_errors_in_one_line(tiny_gguf: Path, tmp_path: Path) -> None:
    cmd = [*WARMSTART, "prepare-model", "smollm2", "--dir", str(tmp_path / "m")]
    ok = subprocess.run([*cmd, "--gguf", str(tiny_gguf)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(tmp_path / "m")
    # stderr is no terminal here: transformers' progress bars (carriage-return redraws) stay out of it
    assert "\r" not in ok.stderr and "de-quantizing" not in ok.stderr, ok.stderr[-500:]
    missing = subprocess.run([*cmd[:-1], str(tmp_path / "n"), "--gguf", str(tmp_path / "absent.gguf")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [f"warmstart: error: --gguf {tmp_path / 'absent.gguf'}: no such file"]
