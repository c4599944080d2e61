"""POST /v1/embeddings in OpenAI's shapes: ``input`` (a string, an array of strings, an array of token ids or an
array of those) in, one embedding per input out, as floats or base64 (little-endian float32, as the official
client decodes it), with the prompt tokens counted in ``usage``."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from warmstart.handlers.openai.requests import Body, ServedModel, _adapter, _token_ids, bad, json_type

FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "add_special_tokens"}
ENCODINGS = ("float", "base64")
MAX_INPUTS = 2048  # as OpenAI's embeddings endpoint


@dataclass
class EmbeddingsCall:
    inputs: list[list[int]]
    encoding_format: str


def parse_embeddings(body: Any, model: ServedModel, dimensions: int) -> EmbeddingsCall:
    """The inputs' token ids; a 400 naming the field for what cannot be served. ``dimensions``: the size of this
    model's embeddings (a request may name it, not another)."""
    b = Body(body, FIELDS, "embeddings")
    if _adapter(b, model) is not None:
        raise bad("embeddings come from the base model; name the served model, not an adapter", "model")
    encoding = b.string("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad(f"encoding_format must be float or base64, got {encoding[:40]!r}", "encoding_format")
    asked = b.integer("dimensions", None, 1)
    if asked is not None and asked != dimensions:
        raise bad(f"dimensions: this model's embeddings have {dimensions} dimensions and are not shortened; "
                  "leave dimensions out", "dimensions")
    raw = b.raw.get("input")
    if raw is None or raw == "" or raw == []:
        raise bad("input is required: a string, an array of strings, or token ids", "input")
    if isinstance(raw, str) or (isinstance(raw, list) and isinstance(raw[0], int) and not isinstance(raw[0], bool)):
        items = [raw]
    elif isinstance(raw, list):
        items = raw
    else:
        raise bad(f"input must be a string, an array of strings or an array of token ids, got {json_type(raw)}",
                  "input")
    if len(items) > MAX_INPUTS:
        raise bad(f"input holds {len(items)} items; at most {MAX_INPUTS} per request", "input")
    special = b.boolean("add_special_tokens", True)
    return EmbeddingsCall([_tokens(item, i, model, special) for i, item in enumerate(items)], encoding)


def _tokens(item: Any, i: int, model: ServedModel, add_special_tokens: bool) -> list[int]:
    where = f"input[{i}]"
    if isinstance(item, str):
        if not item:
            raise bad(f"{where} is empty", "input")
        if model.tokenizer is None:
            raise bad("this model has no tokenizer; send token ids instead of text", "input")
        model.check_text_length(len(item), "input")
        try:
            ids = model.tokenizer.encode(item, add_special_tokens=add_special_tokens)
        except UnicodeError:
            raise bad(f"{where} is not valid Unicode text (it holds a lone surrogate)", "input") from None
    elif isinstance(item, list) and item:
        ids = _token_ids(item, model.vocab_size, "input")
    else:
        raise bad(f"{where} must be a non-empty string or array of token ids, got {json_type(item)}", "input")
    if len(ids) > model.max_model_len:
        raise bad(f"{where} is {len(ids)} tokens, more than this model's context of {model.max_model_len}", "input")
    return list(ids)


def embeddings_reply(call: EmbeddingsCall, vectors: list[Any], model_name: str) -> dict[str, Any]:
    """The response body for one embedding per input, in input order (``vectors``: float32 tensors)."""
    data = []
    for index, vector in enumerate(vectors):
        values = vector.numpy().astype("<f4")
        embedding: Any = base64.b64encode(values.tobytes()).decode() if call.encoding_format == "base64" else (
            values.tolist())
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(map(len, call.inputs))
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
