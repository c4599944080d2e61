"""POST /tokenize and POST /detokenize in vLLM's shapes: text (or chat messages, rendered by the chat template)
to token ids, and token ids back to text, with the served model's tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from warmstart.handlers.openai.requests import Body, ServedModel, _adapter, _messages, _token_ids, bad

if TYPE_CHECKING:
    pass

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def tokenize(body: Any, model: ServedModel) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens", "token_strs"} for a prompt or for chat messages."""
    b = Body(body, TOKENIZE_FIELDS, "tokenize")
    _adapter(b, model)  # the model named must be the one served (or one of its adapters)
    tok = model.tokenizer
    if tok is None:
        raise bad("this model has no tokenizer; there is nothing to tokenize with")
    if b.raw.get("messages") is not None:
        if b.raw.get("prompt") is not None:
            raise bad("send prompt or messages, not both", "prompt")
        if tok.chat_template is None:
            raise bad("this model has no chat template; send a prompt instead of messages", "messages")
        messages = _messages(b.raw["messages"])
        model.check_text_length(sum(len(m["content"]) for m in messages), "messages")
        ids = _render_chat(model, messages, b.boolean("add_generation_prompt", True))  # as a chat request's prompt
        if b.boolean("add_special_tokens", False):
            ids = tok.encode("", add_special_tokens=True) + ids  # what the tokenizer's post-processor puts in front
    else:
        prompt = b.string("prompt")
        if prompt is None:
            raise bad("prompt is required (or messages, for a chat)", "prompt")
        model.check_text_length(len(prompt), "prompt")
        try:
            ids = tok.encode(prompt, add_special_tokens=b.boolean("add_special_tokens", True))
        except UnicodeError:
            raise bad("prompt is not valid Unicode text (it holds a lone surrogate)", "prompt") from None
    strs = [model.token_text(t) for t in ids] if b.boolean("return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: Any, model: ServedModel) -> dict[str, Any]:
    """{"prompt": text} for token ids (special tokens written out, as vLLM does)."""
    b = Body(body, DETOKENIZE_FIELDS, "detokenize")
    _adapter(b, model)
    tokens = b.get("tokens", (list,), "an array of token ids")
    if tokens is None:
        raise bad("tokens is required: an array of token ids", "tokens")
    if len(tokens) > model.max_model_len:
        raise bad(f"tokens holds {len(tokens)} ids, more than this model's context of {model.max_model_len}",
                  "tokens")
    if model.tokenizer is None:
        raise bad("this model has no tokenizer; there is nothing to detokenize with")
    ids = _token_ids(tokens, model.vocab_size, "tokens")
    try:
        return {"prompt": model.tokenizer.decode(ids, skip_special_tokens=False)}
    except Exception:  # an id past the tokenizer's vocabulary (the model's may be larger)
        raise bad("tokens holds an id this model's tokenizer has no text for", "tokens") from None


def _render_chat(model: ServedModel, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    import jinja2

    assert model.tokenizer is not None
    try:
        return model.tokenizer.encode_chat(messages, add_generation_prompt,
                                           special_tokens_in_content=model.special_tokens_in_content)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise bad(f"the chat template cannot render these messages: {e}", "messages") from None
