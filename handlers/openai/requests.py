"""OpenAI requests in: a body becomes prompt token ids and SamplingParams, or a 4xx with OpenAI's error body.

Validation happens here, with the OpenAI field names in the messages, so the engine only ever sees requests
it accepts. The engine's own checks stay as a second line (its ValueErrors also become 400s). The replies'
shapes are in handlers.openai.replies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from warmstart.handlers.openai.sampling_controls import FieldError, choices, sampling_controls
from warmstart.handlers.openai.structured_request import FIELDS as STRUCTURED
from warmstart.handlers.openai.structured_request import StructuredFieldError, structured_outputs
from warmstart.handlers.openai.tool_calls import (
    MISTRAL_MARKER,
    ToolFieldError,
    ToolRequest,
    forced_text,
    history_tool_calls,
    parser_for_template,
    tool_request,
)

if TYPE_CHECKING:  # the runtime imports torch; this module is imported before the server listens
    from warmstart.runtime.sampling_params import SamplingParams
    from warmstart.runtime.structured_outputs import StructuredOutputsParams
    from warmstart.runtime.tokenizer import Tokenizer

MAX_LOGPROBS = 20
MAX_STOP = 16
SEED_RANGE = (-(2**63), 2**64 - 1)

ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """A request that cannot be served; becomes {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# -- what the parser needs to know about the served model -----------------------------------------------------


@dataclass
class Prefix:
    name: str
    kind: str  # "text": prepended as tokens; "system": a chat system prompt rendered by the chat template
    token_ids: list[int]


@dataclass
class ServedModel:
    name: str
    snapshot_id: str
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    kv_cache_tokens: int  # what the KV pool less its pinned blocks holds; no single request may need more
    prefixes: dict[str, Prefix] = field(default_factory=dict)
    adapters: dict[str, int] = field(default_factory=dict)  # name -> virtual tokens in front of the prompt
    select_adapter: Callable[[list[int]], str] | None = None  # the "auto" selector, when the snapshot has one
    # (prompt ids, adapter) -> tokens that may follow them in the KV pool (the engine's kv_room); None: the above
    kv_room: Callable[[list[int], str | None], int] | None = None
    # The model's generation_config.json sampling (temperature, top_p, top_k, min_p): what a request omitting them gets
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    reasoning_parser: str | None = None  # --reasoning-parser: qwen3 or deepseek_r1 (handlers/openai/reasoning.py)
    tool_call_parser: str | None = None  # --tool-call-parser (handlers/openai/tool_calls.py); None: the template's
    special_tokens_in_content: bool = False  # --special-tokens-in-content: a request's text may hold control tokens
    created: int = field(default_factory=lambda: int(time.time()))
    _system_head: list[int] | None = field(default=None, init=False, repr=False)
    _max_text: int | None = field(default=None, init=False, repr=False)

    def system_head(self) -> list[int]:
        """What the chat template writes before the first user message's text, behind a placeholder system
        prompt: the same split the snapshot build used to cut system prefixes."""
        if self._system_head is None:
            assert self.tokenizer is not None
            self._system_head = self.tokenizer.system_prompt_tokens(SYSTEM_PLACEHOLDER)
        return self._system_head

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse text too long for the context before tokenizing it, which costs about 1 s of CPU per MB.

        No token covers more characters than the longest vocabulary entry (the factor 2 leaves room for
        normalizers that merge characters), but for real vocabularies (entries of 100+ characters) that bound
        exceeds any body, so it is capped at MAX_CHARS_PER_TOKEN: text averaging more characters per token (long
        runs of one character) is refused even where it would fit, and can be sent as token ids instead."""
        if self._max_text is None:
            assert self.tokenizer is not None
            longest = max(map(len, self.tokenizer.hf.get_vocab(with_added_tokens=True)), default=1)
            self._max_text = min(2 * longest, MAX_CHARS_PER_TOKEN) * self.max_model_len
        if chars > self._max_text:
            raise bad(f"the prompt is {chars} characters, more than this model's context of {self.max_model_len} "
                      f"tokens can hold (at most {self._max_text} characters are tokenized); shorten the prompt, "
                      "or send it as token ids", param, "context_length_exceeded")

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is not None:
            try:
                return self.tokenizer.decode([token_id], skip_special_tokens=False)
            except Exception:  # an id past the tokenizer's vocabulary (the model's may be larger)
                pass
        return f"token_id:{token_id}"


SYSTEM_PLACEHOLDER = "."
MAX_CHARS_PER_TOKEN = 32  # prose averages 4 to 5 characters per token, code 3 to 4


# -- requests ----------------------------------------------------------------------------------------------


@dataclass
class Generation:
    """A validated request, ready for the engine."""

    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top-n alternatives asked for per token; None: no logprobs
    adapter: str | None = None
    ignored_fields: list[str] = field(default_factory=list)  # fields of the body this server ignored
    n: int = 1  # choices returned (params.n are generated: best_of, the best n kept by cumulative logprob)
    echo: str | None = None  # completions with echo: the prompt's text, before each choice's
    tool_parser: str | None = None  # chat with tools: the format tool calls are read from the reply in
    prompt_logprobs: int | None = None  # completions: vLLM's prompt_logprobs, the top-n per prompt token
    model_name: str | None = None  # the model replies report where not the served name (see _reply_model)


COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "n", "stream", "stream_options", "user", "prefix", "include_stop_str_in_output",
                 "logprobs", "adapter", "speculative", "skip_special_tokens", "cache_salt"}
# Known fields whose effect is not implemented: accepted only at the value that changes nothing.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v == "",
    "functions": lambda v: v == [],
    "function_call": lambda v: v in ("none", "auto"),
    # vLLM's own fields that change what is generated; refused unless they ask for what happens anyway
    "use_beam_search": lambda v: v is False,
    "length_penalty": lambda v: v == 1,
    "allowed_token_ids": lambda v: False,
    "truncate_prompt_tokens": lambda v: False,
    "logits_processors": lambda v: v == [],
    "spaces_between_special_tokens": lambda v: v is True,
    "return_tokens_as_token_ids": lambda v: v is False,
    "add_generation_prompt": lambda v: v is True,
    "continue_final_message": lambda v: v is False,
    "chat_template": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
}
# Checked by handlers.openai.sampling_controls.
SAMPLING_NEUTRAL = {"frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                    "bad_words"}
IGNORED = {"metadata", "store", "service_tier", "parallel_tool_calls"}  # no effect on what is generated
# Fields outside every list above are accepted and ignored, as vLLM does (clients and SDKs add fields as they go:
# reasoning_effort, prompt_cache_key, safety_identifier...); Metrics.count_ignored counts them by name.
COMPLETION_FIELDS = (COMMON_FIELDS | SAMPLING_NEUTRAL | {"prompt", "best_of", "echo", "suffix", "prompt_logprobs"}
                     | IGNORED | STRUCTURED)
CHAT_FIELDS = (COMMON_FIELDS | SAMPLING_NEUTRAL | IGNORED | STRUCTURED | {"messages", "max_completion_tokens",
               "top_logprobs",
               "tools", "tool_choice", "functions", "function_call", "response_format", "chat_template_kwargs",
               "documents"})
# What the template itself is given (transformers' apply_chat_template arguments): chat_template_kwargs cannot set them.
TEMPLATE_ARGUMENTS = {"messages", "tools", "documents", "add_generation_prompt"}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def parse_completion(body: Any, model: ServedModel) -> Generation:
    b = Body(body, COMPLETION_FIELDS, "completions")
    adapter = _adapter(b, model)
    prefix = _prefix(b, model)
    ids = _completion_prompt(b.raw.get("prompt"), model, prefix)
    if adapter == "auto":
        prompt = b.raw["prompt"]
        adapter = _auto(model, prompt if isinstance(prompt, str | list) else "", ids)
    logprobs = b.integer("logprobs", None, 0, MAX_LOGPROBS)
    gen = _finish(b, model, ids, chat=False, logprobs=logprobs, prompt_param="prompt", adapter=adapter)
    gen.model_name = _reply_model(b, model, adapter)
    gen.prompt_logprobs = b.integer("prompt_logprobs", None, 0, MAX_LOGPROBS)
    echoed = None
    if b.boolean("echo", False):
        gen.echo = _echo_text(b.raw.get("prompt"), ids, model)
        echoed = logprobs  # the echoed prompt's logprobs, where asked
    # Computed once for both; each reply keeps its own top-n (openai_responses).
    asked = [n for n in (gen.prompt_logprobs, echoed) if n is not None]
    gen.params.prompt_logprobs = max(asked) if asked else None
    return gen


def _echo_text(prompt: Any, ids: list[int], model: ServedModel) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return model.tokenizer.decode(ids, skip_special_tokens=False) if model.tokenizer is not None else ""


def parse_chat(body: Any, model: ServedModel) -> Generation:
    b = Body(body, CHAT_FIELDS, "chat completions")
    if b.raw.get("prompt_logprobs") is not None:
        raise bad("prompt_logprobs is supported on /v1/completions only; leave it out of chat requests",
                  "prompt_logprobs")
    adapter = _adapter(b, model)
    prefix = _prefix(b, model)
    messages = _history_in_forced_form(_messages(b.raw.get("messages")), model)
    tools = _tools(b, model)
    template_kwargs = _template_kwargs(b)
    if tools is not None:
        template_kwargs["tools"] = tools.tools
    ids = _chat_prompt(messages, model, prefix, template_kwargs)
    if adapter == "auto":
        users = [m["content"] for m in messages if m["role"] == "user"]
        adapter = _auto(model, users[-1] if users else messages[-1]["content"], ids)
    want = b.boolean("logprobs", False)
    top = b.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs needs logprobs set to true", "top_logprobs")
    gen = _finish(b, model, ids, chat=True, logprobs=(top or 0) if want else None, prompt_param="messages",
                  adapter=adapter)
    gen.model_name = _reply_model(b, model, adapter)
    if tools is not None:
        _use_tools(gen, tools)
    return gen


def _history_in_forced_form(messages: list[dict[str, Any]], model: ServedModel) -> list[dict[str, Any]]:
    """Where no tool-call format is known (the template shows none and no --tool-call-parser names one), an earlier
    assistant turn's calls are written into its content as the forced calls were (tool_calls.FORCED): a template
    that ignores tool_calls would otherwise show the model an empty turn before the tool's result."""
    template = model.tokenizer.chat_template if model.tokenizer is not None else None
    if model.tool_call_parser is not None or parser_for_template(template) is not None:
        return messages
    return [{**m, "content": forced_text(m["tool_calls"])} if m.get("tool_calls") and not m["content"] else m
            for m in messages]


def _tools(b: Body, model: ServedModel) -> ToolRequest | None:
    template = model.tokenizer.chat_template if model.tokenizer is not None else None
    mistral_token = model.tokenizer.hf.token_to_id(MISTRAL_MARKER) if model.tokenizer is not None else None
    try:
        return tool_request(b.raw, template, model.tool_call_parser, mistral_token)
    except ToolFieldError as e:
        raise bad(str(e), e.param) from None


def _use_tools(gen: Generation, tools: ToolRequest) -> None:
    """Read calls out of the reply; with tool_choice required or named, decode under the calls' grammar."""
    from warmstart.runtime.structured_outputs import StructuredOutputsParams

    gen.tool_parser = tools.parser
    if tools.parser == "mistral":  # its calls start at the [TOOL_CALLS] special token, which the text must keep
        gen.params.skip_special_tokens = False
    if tools.grammar is not None:
        if gen.params.structured_outputs is not None:
            raise bad("tool_choice required or a named function already constrains the output; leave out "
                      "response_format (or the structured outputs fields)", "tool_choice")
        gen.params.structured_outputs = StructuredOutputsParams(grammar=tools.grammar)


class Body:
    """A JSON object read field by field, each checked for type and range with a message naming the field."""

    def __init__(self, raw: Any, allowed: set[str], endpoint: str) -> None:
        if not isinstance(raw, dict):
            raise bad(f"the request body must be a JSON object, got {json_type(raw)}")
        self.ignored = sorted(k for k in raw if k not in allowed and k not in NEUTRAL)
        for name, neutral in NEUTRAL.items():
            value = raw.get(name)
            if value is not None and not neutral(value):
                raise bad(f"{name} is not supported by this server; leave it out", name)
        self.raw: dict[str, Any] = raw

    def get(self, name: str, kinds: tuple[type, ...], what: str) -> Any:
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) and bool not in kinds:
            raise bad(f"{name} must be {what}, got a boolean", name)
        if not isinstance(value, kinds):
            raise bad(f"{name} must be {what}, got {json_type(value)}", name)
        return value

    def integer(self, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
        value = self.get(name, (int,), "an integer")
        if value is None:
            return default
        if value < lo or (hi is not None and value > hi):
            raise bad(f"{name} must be {_range(lo, hi)}, got {value}", name)
        return int(value)

    def number(self, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
        value = self.get(name, (int, float), "a number")
        if value is None:
            return default
        ok = (lo < value if lo_open else lo <= value) and value <= hi  # NaN fails every comparison
        if not ok:
            raise bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}", name)
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, (bool,), "true or false")
        return default if value is None else bool(value)

    def string(self, name: str) -> str | None:
        value = self.get(name, (str,), "a string")
        return None if value is None else str(value)


def _range(lo: int, hi: int | None) -> str:
    return f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _adapter(b: Body, model: ServedModel) -> str | None:
    """The adapter a request names, by "adapter" or in "model" (see _adapter_in_model); also checks that the
    model is the one served."""
    named = b.string("adapter")
    in_model = _adapter_in_model(b.string("model"), model)
    if in_model is not None and named is not None and named != in_model:
        raise bad(f"the request names adapter {in_model[:80]!r} in model and {named[:80]!r} in adapter; name one",
                  "adapter")
    name = named if named is not None else in_model
    if name is None or name in model.adapters or (name == "auto" and model.select_adapter is not None):
        return name
    known = ", ".join(sorted(model.adapters)) or "none"
    if name == "auto":
        why = "adapter 'auto' needs a snapshot built with --adapter-examples"
    else:
        why = f"unknown adapter {name[:80]!r}"
    raise APIError(404, f"{why}; this snapshot's adapters: {known}", param="adapter" if named is not None else "model",
                   code="adapter_not_found")


def _reply_model(b: Body, model: ServedModel, adapter: str | None) -> str | None:
    """The model a reply reports: as vLLM, the name the client sent where it named the adapter (bare or
    BASE:NAME); else BASE:NAME for an adapter named by "adapter" or chosen by "auto"; None: the served name."""
    if adapter is None:
        return None
    requested = b.string("model")
    if requested is not None and _adapter_in_model(requested, model) == adapter:
        return requested
    return f"{model.name}:{adapter}"


def _adapter_in_model(requested: str | None, model: ServedModel) -> str | None:
    """The adapter "model" names as vLLM addresses LoRA adapters, by its bare name, or as "BASE:NAME"; None for the
    base model (its served name or snapshot id, even one holding a colon); a 404 for a model not served here."""
    if requested is None or requested in (model.name, model.snapshot_id):
        return None
    if requested in model.adapters:
        return requested
    base, colon, name = requested.partition(":")
    if colon and base in (model.name, model.snapshot_id):
        return name
    raise APIError(404, f"model {requested[:80]!r} is not served here; this server serves {model.name!r}"
                   + (f" with adapters {', '.join(sorted(model.adapters))}" if model.adapters else ""),
                   param="model", code="model_not_found")


def _auto(model: ServedModel, query: str | list[Any], ids: list[int]) -> str:
    """The selector's adapter for the user's own text (not the template around it): the build measured it on
    bare example queries."""
    assert model.select_adapter is not None
    if isinstance(query, str) and model.tokenizer is not None:
        ids = model.tokenizer.encode(query, add_special_tokens=False) or ids
    return model.select_adapter(ids)


def _prefix(b: Body, model: ServedModel) -> Prefix | None:
    name = b.string("prefix")
    if name is None:
        return None
    if name not in model.prefixes:
        known = ", ".join(sorted(model.prefixes)) or "none"
        raise bad(f"unknown prefix {name[:100]!r}; this snapshot's prefixes: {known}", "prefix", "prefix_not_found")
    return model.prefixes[name]


def _completion_prompt(prompt: Any, model: ServedModel, prefix: Prefix | None) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise bad("this model has no tokenizer; send prompt as an array of token ids", "prompt")
        model.check_text_length(len(prompt), "prompt")
        # Behind a prefix the text continues a sequence that already began, so no BOS in the middle.
        try:
            ids = model.tokenizer.encode(prompt, add_special_tokens=prefix is None) if prompt else []
        except UnicodeError:
            raise bad("prompt is not valid Unicode text (it holds a lone surrogate)", "prompt") from None
    elif isinstance(prompt, list):
        if len(prompt) > 1 and any(isinstance(p, str | list) for p in prompt):
            raise bad(f"one prompt per request is supported, got {len(prompt)}; send them as separate requests",
                      "prompt")
        if len(prompt) > model.max_model_len:  # before checking each id, which costs per id
            raise bad(f"the prompt is {len(prompt)} tokens; this model's context is {model.max_model_len} tokens; "
                      "shorten the prompt", "prompt", "context_length_exceeded")
        ids = _token_ids(prompt, model.vocab_size, "prompt")
    elif prompt is None:
        raise bad("prompt is required", "prompt")
    else:
        raise bad(f"prompt must be a string or an array of token ids, got {json_type(prompt)}", "prompt")
    ids = (prefix.token_ids if prefix else []) + ids
    if not ids:
        raise bad("prompt is empty", "prompt")
    return ids


def _token_ids(values: list[Any], vocab_size: int, param: str) -> list[int]:
    for i, t in enumerate(values):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            shown = json.dumps(t)[:40]
            raise bad(f"{param}[{i}] must be a token id, an integer in [0, {vocab_size}), got {shown}", param)
    return list(values)


def _messages(raw: Any) -> list[dict[str, str]]:
    if raw is None:
        raise bad("messages is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty array of {role, content} objects", "messages")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content, got {json_type(m)}", "messages")
        extra = sorted(k for k in m if k not in ("role", "content", "name", "tool_calls", "tool_call_id"))
        if extra:
            raise bad(f"{where}.{extra[0]} is not supported by this server", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            shown = json.dumps(role)[:40]
            raise bad(f"{where}.role must be one of system, developer, user, assistant, tool, got {shown}",
                      "messages")
        if "name" in m and not isinstance(m["name"], str):
            raise bad(f"{where}.name must be a string, got {json_type(m['name'])}", "messages")
        messages.append(_message(m, CHAT_ROLES[role], where))
    return messages


def _message(m: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """One message for the chat template; an assistant's tool_calls and a tool result's tool_call_id kept."""
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise bad(f"{where}.tool_calls is only allowed on an assistant message", "messages")
        try:
            calls = history_tool_calls(m["tool_calls"], where)
        except ToolFieldError as e:
            raise bad(str(e), e.param) from None
        content = m.get("content")
        return {"role": role, "content": "" if content is None else _content(content, where), "tool_calls": calls}
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad(f"{where}.tool_call_id is required on a tool message (the id of the call it answers)",
                      "messages")
        return {"role": role, "content": _content(m.get("content"), where), "tool_call_id": call_id}
    if m.get("tool_call_id") is not None:
        raise bad(f"{where}.tool_call_id is only allowed on a tool message", "messages")
    return {"role": role, "content": _content(m.get("content"), where)}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else json_type(part)
                raise bad(f"{where}.content[{j}] must be a text part ({{type: text, text: ...}}); "
                          f"this server supports text only, got {json.dumps(kind)[:40]}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{where}.content must be a string or an array of text parts, got {json_type(content)}", "messages")


def _template_kwargs(b: Body) -> dict[str, Any]:
    """What the request gives the chat template beside the messages: `documents` and `chat_template_kwargs` (e.g.
    Qwen3's enable_thinking), as vLLM passes them."""
    extra = b.get("chat_template_kwargs", (dict,), "an object") or {}
    taken = sorted(TEMPLATE_ARGUMENTS & set(extra))
    if taken:
        raise bad(f"chat_template_kwargs cannot set {taken[0]!r}; send it as the request's own field",
                  "chat_template_kwargs")
    documents = b.get("documents", (list,), "an array of objects")
    if documents is not None:
        if not all(isinstance(d, dict) for d in documents):
            raise bad("documents must be an array of objects (e.g. {title, text})", "documents")
        return {**extra, "documents": documents}
    return dict(extra)


def _chat_prompt(messages: list[dict[str, str]], model: ServedModel, prefix: Prefix | None,
                 template_kwargs: dict[str, Any] | None = None) -> list[int]:
    tok = model.tokenizer
    if tok is None or tok.chat_template is None:
        raise bad("this model has no chat template; use /v1/completions with a plain prompt", "messages")
    template_kwargs = template_kwargs or {}
    extra_chars = len(json.dumps(template_kwargs)) if template_kwargs else 0
    model.check_text_length(sum(len(m["content"]) for m in messages) + extra_chars, "messages")
    if prefix is not None and prefix.kind == "system":
        # The prefix is the system turn (and the next turn's header): splice the messages in after it.
        if any(m["role"] == "system" for m in messages):
            raise bad(f"prefix {prefix.name!r} is a system prompt; leave the system message out or the prefix",
                      "prefix")
        ids = _render(model, [{"role": "system", "content": SYSTEM_PLACEHOLDER}, *messages], template_kwargs)
        head = model.system_head()
        if ids[: len(head)] != head:
            raise bad(f"prefix {prefix.name!r} is a system prompt, which the chat template puts before a user "
                      "message; start the messages with a user message", "messages")
        return prefix.token_ids + ids[len(head) :]
    ids = _render(model, messages, template_kwargs)
    return (prefix.token_ids if prefix else []) + ids


def _render(model: ServedModel, messages: list[dict[str, str]], template_kwargs: dict[str, Any]) -> list[int]:
    import jinja2

    assert model.tokenizer is not None
    try:
        return model.tokenizer.encode_chat(messages, special_tokens_in_content=model.special_tokens_in_content,
                                           **template_kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise bad(f"the chat template cannot render these messages: {e}", "messages") from None


def _finish(b: Body, model: ServedModel, ids: list[int], *, chat: bool, logprobs: int | None,
            prompt_param: str, adapter: str | None) -> Generation:
    from warmstart.runtime.sampling_params import SamplingParams

    b.string("user")
    stream = b.boolean("stream", False)
    options = b.get("stream_options", (dict,), "an object")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        if options.get("continuous_usage_stats"):  # other fields of stream_options are ignored
            raise bad("stream_options.continuous_usage_stats is not supported by this server; leave it out",
                      "stream_options")
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise bad(f"stream_options.include_usage must be true or false, got {json_type(usage)}", "stream_options")
        include_usage = bool(usage)

    virtual = model.adapters[adapter] if adapter is not None else 0
    room = model.max_model_len - virtual - len(ids)
    behind = f" behind the {virtual} virtual tokens of adapter {adapter!r}" if virtual else ""
    if room < 1:
        raise bad(f"the prompt is {len(ids)} tokens{behind}; this model's context is {model.max_model_len} tokens "
                  "(it must also leave room for one generated token); shorten the prompt", prompt_param,
                  "context_length_exceeded")
    name = "max_completion_tokens" if chat and b.raw.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = b.integer(name, None, 1)
    if max_tokens is None:
        # OpenAI's completions default is 16; chat runs until the context (or the KV pool) is full.
        fits = (model.kv_room(ids, adapter) if model.kv_room is not None
                else min(model.max_model_len, model.kv_cache_tokens) - virtual - len(ids))
        max_tokens = min(16, room) if not chat else max(1, min(room, fits))
    elif max_tokens > room:
        raise bad(f"the prompt is {len(ids)} tokens{behind} and {name} is {max_tokens}, "
                  f"{virtual + len(ids) + max_tokens} in all; this model's context is {model.max_model_len} tokens "
                  f"(lower {name} to at most {room})", name,
                  "context_length_exceeded")

    defaults = model.sampling_defaults
    top_k = b.integer("top_k", int(defaults.get("top_k", 0)), -1)
    assert top_k is not None
    structured = _structured_outputs(b)
    try:
        n, best_of = choices(b.raw, stream, chat)
        controls = sampling_controls(b.raw, max_tokens, model.vocab_size, model.tokenizer, defaults)
    except FieldError as e:
        raise bad(str(e), e.param) from None
    # best_of ranks the choices by their tokens' logprobs; the reply shows them only where asked (gen.logprobs)
    ranked = 0 if best_of > n and logprobs is None else logprobs
    cache_salt = b.string("cache_salt")
    if cache_salt is not None and not cache_salt:
        raise bad("cache_salt must be a non-empty string (or left out)", "cache_salt")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=b.number("temperature", defaults.get("temperature", 1.0), 0.0, 100.0),
            top_p=b.number("top_p", defaults.get("top_p", 1.0), 0.0, 1.0, lo_open=True),
            top_k=0 if top_k >= model.vocab_size else top_k,
            min_p=b.number("min_p", defaults.get("min_p", 0.0), 0.0, 1.0),
            seed=b.integer("seed", None, *SEED_RANGE),
            stop=_stop(b),
            stop_token_ids=_stop_token_ids(b, model.vocab_size),
            ignore_eos=b.boolean("ignore_eos", False),
            skip_special_tokens=b.boolean("skip_special_tokens", True),
            logprobs=ranked,
            include_stop_str_in_output=b.boolean("include_stop_str_in_output", False),
            speculative=b.boolean("speculative", True),
            structured_outputs=structured,
            n=best_of,
            cache_salt=cache_salt,
            **controls,
        )
    except ValueError as e:  # the runtime's own checks: kept as a second line
        raise bad(str(e)) from None
    return Generation(chat, ids, params, stream, include_usage, logprobs, adapter, ignored_fields=b.ignored, n=n)


def _structured_outputs(b: Body) -> StructuredOutputsParams | None:
    try:
        return structured_outputs(b.raw)
    except StructuredFieldError as e:
        raise bad(str(e), e.param) from None


def _stop(b: Body) -> list[str]:
    stop = b.raw.get("stop")
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("stop must be a non-empty string or an array of non-empty strings", "stop")
    if len(items) > MAX_STOP:
        raise bad(f"stop holds {len(items)} strings; at most {MAX_STOP} are supported", "stop")
    return list(items)


def _stop_token_ids(b: Body, vocab_size: int) -> list[int]:
    from warmstart.runtime.sampling_params import MAX_STOP_TOKEN_IDS

    ids = b.get("stop_token_ids", (list,), "an array of token ids")
    if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:  # before checking each id, which costs per id
        raise bad(f"stop_token_ids holds {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are supported", "stop_token_ids")
    return [] if ids is None else _token_ids(ids, vocab_size, "stop_token_ids")
