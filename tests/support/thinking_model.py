"""A tiny model that thinks: its greedy chat reply opens with `<think>` and closes it with `</think>` a few tokens
later, built exactly, without training. The tokenizer leaves the model's last two ids to the added tokens
`<think>` and `</think>`; the greedy reply of a random model is computed, and two of its tokens (its first, and a
later one) swap ids with those two in both the embeddings and the head. The swapped model is the same function
with those ids relabelled, so its greedy reply is the old one with `<think>` and `</think>` in their places."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from tests.support.model_configs import FAMILIES
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.random_model import make_random_model

QWEN3_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "qwen3.jinja"
REPLY_TOKENS = 12


@dataclass
class ThinkingModel:
    dir: Path
    messages: list[dict[str, Any]]
    reasoning: str  # what the greedy reply of REPLY_TOKENS tokens thinks, between the tags
    content: str  # and what it answers after them


def thinking_model_dir(root: Path, messages: list[dict[str, Any]]) -> ThinkingModel:
    config = FAMILIES["llama"]  # untied embeddings: the head and the embeddings swap rows separately
    vocab = int(config["vocab_size"])
    plain = make_random_model(root / "plain", config, seed=0, dtype="float32", vocab_size_tokenizer=vocab - 2)
    _use_template(plain)
    llm = LLM.from_hf(plain, dtype="float32", num_kv_blocks=64)
    prompt = llm.tokenizer.encode_chat(messages)
    reply = llm.generate([prompt], SamplingParams(max_tokens=REPLY_TOKENS, temperature=0, ignore_eos=True))[0]
    ids = reply.token_ids
    start, end = ids[0], next(t for t in ids[2:] if t not in (ids[0], ids[1]))
    assert start not in prompt and end not in prompt and ids.count(end) == 1 and ids.count(start) == 1, ids
    think = root / "thinking"
    shutil.copytree(plain, think)
    _swap_rows(think / "model.safetensors", {start: vocab - 2, end: vocab - 1})
    _add_think_tokens(think / "tokenizer.json", vocab - 2)
    k = ids.index(end)
    decode = llm.tokenizer.decode
    return ThinkingModel(think, messages, decode(ids[1:k]), decode(ids[k + 1 :]))


def _use_template(model_dir: Path) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_TEMPLATE.read_text()
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def _swap_rows(path: Path, pairs: dict[int, int]) -> None:
    tensors = load_file(str(path))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = tensors[name].clone()
        for a, b in pairs.items():
            w[[a, b]] = w[[b, a]]
        tensors[name] = w
    save_file(tensors, str(path), metadata={"format": "pt"})


def _add_think_tokens(path: Path, first_id: int) -> None:
    tok = json.loads(path.read_text())
    for i, content in enumerate(("<think>", "</think>")):
        tok["added_tokens"].append({"id": first_id + i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    path.write_text(json.dumps(tok))
