"""A tiny Llama written as a GGUF file with the `gguf` package, as llama.cpp's converter lays one out: the GGUF
inputs' tests need no download."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

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
