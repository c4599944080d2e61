"""`warmstart prepare-model`: a GGUF checkpoint becomes an HF directory that the engine serves like transformers.

Offline: the GGUF is a tiny Llama written here with the `gguf` package (the real one is downloaded only by the
command itself), and the conversion runs through the same code path as the download.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import WARMSTART
from tests.support.reference import assert_matches_reference
from warmstart.snapshot.prepare_model import READY_MARK, PrepareError, prepare_model

gguf = pytest.importorskip("gguf", reason="the `gguf` package (test extra) writes the tiny checkpoint")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 96


def byte_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: a byte-level BPE vocabulary that needs no merges."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in printable]
    codes = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [codes[b] for b in range(256)] + ["<|im_start|>", "<|im_end|>"]


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tokens = byte_vocab()
    head_dim = HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(len(tokens), HIDDEN))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(HIDDEN, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(KV_HEADS * head_dim, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(KV_HEADS * head_dim, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(HIDDEN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(FFN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(FFN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", mat(len(tokens), HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
