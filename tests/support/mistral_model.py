"""A tiny random model behind Mistral's tool-calling chat template whose tokenizer has the `[TOOL_CALLS]` special
token (the model's last id, as Mistral's tokenizers give it an id of its own), so that the token must survive
detokenization for a call to be read out of the reply."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.model_configs import FAMILIES
from warmstart.runtime.random_model import make_random_model

MISTRAL_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "mistral.jinja"
TOOL_CALLS = "[TOOL_CALLS]"


def mistral_tool_model_dir(root: Path) -> tuple[Path, int]:
    """The model directory and the id of its `[TOOL_CALLS]` token."""
    config = FAMILIES["llama"]
    vocab = int(config["vocab_size"])
    model = make_random_model(root / "mistral-tools", config, seed=0, dtype="float32",
                              vocab_size_tokenizer=vocab - 1)
    token_id = vocab - 1
    tok_path = model / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    tok["added_tokens"].append({"id": token_id, "content": TOOL_CALLS, "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    tok_path.write_text(json.dumps(tok))
    config_path = model / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = MISTRAL_TEMPLATE.read_text()
    config_path.write_text(json.dumps(tok_config))
    return model, token_id
