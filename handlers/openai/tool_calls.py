"""Tool calls in a model's output, in the formats of the supported families, and the grammars that force them.

- ``hermes`` (Qwen2.5, Qwen3, Hermes and the templates that copied them): ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``, one block per call; the text before the first block is the content.
- ``llama3_json`` (Llama 3.1-3.3): the whole reply is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (v3 tokenizers), or
  ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+); the text before it is the content. ``[TOOL_CALLS]`` is a
  special token, so the text parsed must keep special tokens (a request under this parser is decoded with
  skip_special_tokens False, as vLLM's mistral parser asks; handlers/openai/requests.py).

``tool_choice`` "required" or a named function is enforced with ``call_grammar``: a Lark grammar (llguidance's
dialect, whose ``%json`` embeds a JSON schema) that admits only calls of the offered functions with arguments
valid against their parameters' schemas, so the arguments always parse. Where the model's chat template shows
no format (and no --tool-call-parser names one) the forced calls take FORCED's, as vLLM forces them through
structured outputs: the whole reply is a JSON array of ``{"name": ..., "parameters": {...}}``; so they work on
every model, and the calls go back into the next turn's prompt in that form.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")
FORCED = "json"  # forced calls where no format is known: the reply is [{"name": ..., "parameters": {...}}, ...]
# The calls' JSON as structured outputs write it (runtime/engine/structured.py): fixed separators, no other
# whitespace, so a small model cannot loop on spaces inside a forced call.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's message.tool_calls[].function.arguments
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    content: str | None  # None when the reply is only tool calls
    tool_calls: list[ToolCall]


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs, or None when it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template or "ipython" in template:
        return "llama3_json"
    return None


def parse_tool_calls(parser: str, text: str) -> ParsedReply:
    """Split a reply into its content and its tool calls; text that is not a well-formed call stays content."""
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3(text)
    if parser == "mistral":
        return _mistral(text)
    if parser == FORCED:
        return _forced(text)
    raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> ParsedReply:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedReply(text, [])
    calls = [_call(_json(m.group(1))) for m in HERMES_BLOCK.finditer(text, start)]
    if not calls or any(c is None for c in calls):
        return ParsedReply(text, [])
    content = text[:start].rstrip()  # what a stream sent before the call (ToolCallStream holds back the spaces)
    return ParsedReply(content or None, [c for c in calls if c is not None])


def _llama3(text: str) -> ParsedReply:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedReply(text, [])
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return ParsedReply(text, [])
        call = _call(obj, "parameters")
        if call is None:
            return ParsedReply(text, [])
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return ParsedReply(None, calls)


def _forced(text: str) -> ParsedReply:
    listed = _json(text.strip())
    calls = [_call(o, "parameters") for o in listed] if isinstance(listed, list) and listed else [None]
    if any(c is None for c in calls):
        return ParsedReply(text, [])
    return ParsedReply(None, [c for c in calls if c is not None])


def forced_text(calls: list[dict[str, Any]]) -> str:
    """Calls from a request's history (see history_tool_calls) as FORCED writes them: how a model whose template
    shows no tool-call format sees its own calls in the next turn."""
    return json.dumps([{"name": c["function"]["name"], "parameters": c["function"]["arguments"]} for c in calls],
                      ensure_ascii=False)


MISTRAL_MARKER = "[TOOL_CALLS]"
MISTRAL_V11 = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")


def _mistral(text: str) -> ParsedReply:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedReply(text, [])
    content = text[:start].rstrip() or None
    rest = text[start + len("[TOOL_CALLS]") :].strip()
    calls: list[ToolCall | None]
    if rest.startswith("["):
        listed = _json(rest)
        calls = [_call(o) for o in listed] if isinstance(listed, list) else [None]
    else:  # name[ARGS]{...} per call, each after its own [TOOL_CALLS]
        calls = []
        decoder = json.JSONDecoder()
        for part in rest.split("[TOOL_CALLS]"):
            m = MISTRAL_V11.match(part.strip())
            try:
                args, _ = decoder.raw_decode(part.strip(), m.end()) if m else (None, 0)
            except ValueError:
                args = None
            calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)) if m and args is not None
                         else None)
    if not calls or any(c is None for c in calls):
        return ParsedReply(text, [])
    for c in calls:
        if c is not None:  # Mistral's templates refuse any other id when the call comes back in the next turn
            c.id = mistral_call_id()
    return ParsedReply(content, [c for c in calls if c is not None])


def mistral_call_id() -> str:
    """Nine letters and digits, the only tool-call id Mistral's chat templates accept (as vLLM makes them)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def call_schema(tools: list[dict[str, Any]], name: str | None = None, arguments_key: str = "arguments"
                ) -> dict[str, Any]:  # fmt: skip
    """The JSON schema of one call of the offered functions (or of the one named)."""
    options = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                         arguments_key: parameters},
                        "required": ["name", arguments_key], "additionalProperties": False})
    if not options:
        raise ValueError(f"no offered function is named {name!r}")
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(parser: str, tools: list[dict[str, Any]], name: str | None = None, parallel: bool = True,
                 mistral_token_id: int | None = None) -> str:
    """A Lark grammar (llguidance) admitting only tool calls in ``parser``'s format: one, or with ``parallel`` one
    or more, of the offered functions (or only ``name``), arguments valid against the function's parameters.
    ``mistral_token_id``: the id of the tokenizer's ``[TOOL_CALLS]`` token; None where it has none (then the
    marker is plain text)."""
    many = "+" if parallel and name is None else ""
    if parser == "hermes":
        schema = json.dumps({**call_schema(tools, name), "x-guidance": COMPACT_JSON})
        return f'start: call{many}\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>"'
    if parser == "llama3_json":
        schema = json.dumps({**call_schema(tools, name, "parameters"), "x-guidance": COMPACT_JSON})
        rest = '(";" call)*' if many else ""
        return f"start: call {rest}\ncall: %json {schema}"
    if parser == "mistral":  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], as Mistral's templates write it
        calls: dict[str, Any] = {"type": "array", "items": call_schema(tools, name), "minItems": 1}
        if not many:
            calls["maxItems"] = 1
        # llguidance names a special token by id, <[id]>: its <name> form takes only angle-bracketed names.
        marker = json.dumps(MISTRAL_MARKER) if mistral_token_id is None else f"<[{mistral_token_id}]>"
        return f"start: {marker} %json {json.dumps({**calls, 'x-guidance': COMPACT_JSON})}"
    if parser == FORCED:
        forced: dict[str, Any] = {"type": "array", "items": call_schema(tools, name, "parameters"), "minItems": 1}
        if not many:
            forced["maxItems"] = 1
        return f"start: %json {json.dumps({**forced, 'x-guidance': COMPACT_JSON})}"
    raise ValueError(f"tool_choice 'required' or a named function is not enforced for the {parser!r} format; "
                     "use tool_choice 'auto'")


class ToolFieldError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]  # as the request gave them: the chat template renders them
    parser: str | None  # how calls are read out of the reply; None with tool_choice "none"
    grammar: str | None  # tool_choice "required" or named: the only replies allowed


def tool_request(raw: dict[str, Any], template: str | None, parser: str | None,
                 mistral_token_id: int | None = None) -> ToolRequest | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked; None without tools.
    ``parser``: the server's --tool-call-parser, else the one the chat template's format needs;
    ``mistral_token_id``: the tokenizer's ``[TOOL_CALLS]`` token (see call_grammar)."""
    tools = raw.get("tools")
    choice = raw.get("tool_choice")
    parallel = raw.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolFieldError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolFieldError("tool_choice needs tools to choose from", "tool_choice")
        return None
    _check_tools(tools)
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice in ("auto", "none", "required"):
        named = None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
        if named not in names:
            raise ToolFieldError(f"tool_choice names function {str(named)[:80]!r}, which is not among the tools "
                                 f"({', '.join(names)})", "tool_choice")
    else:
        raise ToolFieldError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": ...}}', "tool_choice")
    if choice == "none":
        return ToolRequest(tools, None, None)
    parser = parser or parser_for_template(template)
    forced = choice == "required" or named is not None
    if parser is None and not forced:
        raise ToolFieldError("with tool_choice auto the model's calls are read in its own format, and this model's "
                             "chat template shows none this server can read; start the server with "
                             f"--tool-call-parser ({', '.join(PARSERS)}), or send tool_choice \"required\" or a named "
                             "function, which work with every model", "tools")
    parser = parser or FORCED
    grammar = None
    if forced:
        try:
            grammar = call_grammar(parser, tools, named, parallel, mistral_token_id)
        except ValueError as e:
            raise ToolFieldError(str(e), "tool_choice") from None
    return ToolRequest(tools, parser, grammar)


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise ToolFieldError("tools must be an array of {type: function, function: {name, parameters}}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolFieldError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools")
        if not isinstance(function.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
            raise ToolFieldError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", "tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise ToolFieldError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")


def history_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them (arguments as an object, as vLLM
    passes them); raises ToolFieldError."""
    if not isinstance(raw, list):
        raise ToolFieldError(f"{where}.tool_calls must be an array", "messages")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolFieldError(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, "
                                 "arguments}}}}", "messages")
        arguments = function.get("arguments", "{}")
        parsed = _json(arguments) if isinstance(arguments, str) else arguments
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"], "arguments": parsed if parsed is not None else arguments}})
    return calls


class ToolCallStream:
    """A streamed reply under a tool parser: content deltas pass until a call could be starting (text that
    could still become the format's marker is held back); the calls go out whole, parsed, when the reply ends.
    The deltas add up to what ``parse_tool_calls`` makes of the whole reply."""

    MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{", FORCED: "["}

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = False  # a marker was seen: everything from it waits for the end

    def delta(self, new_text: str, finished: bool) -> dict[str, Any]:
        self.text += new_text
        if finished:
            reply = parse_tool_calls(self.parser, self.text)
            if not reply.tool_calls:
                return self._content(len(self.text), final=True)
            content = reply.content or ""
            out: dict[str, Any] = {"content": content[self.sent :]} if len(content) > self.sent else {}
            out["tool_calls"] = [{"index": i, **c.openai()} for i, c in enumerate(reply.tool_calls)]
            return out
        marker = self.MARKERS[self.parser]
        if self.parser in ("llama3_json", FORCED):  # the whole reply is the calls: decided by its first character
            stripped = self.text.lstrip()
            if stripped.startswith((marker, "<|python_tag|>")) or not stripped:
                return {}
            return self._content(len(self.text), final=True)
        at = self.text.find(marker)
        if at >= 0:
            return self._content(at)
        # Hold back a tail that could be the start of the marker.
        keep = next((k for k in range(min(len(marker) - 1, len(self.text)), 0, -1)
                     if marker.startswith(self.text[-k:])), 0)
        return self._content(len(self.text) - keep)

    def _content(self, end: int, final: bool = False) -> dict[str, Any]:
        if not final:  # spaces before a call are not content: held until text follows them
            end = len(self.text[:end].rstrip())
        end = max(end, self.sent)
        piece = self.text[self.sent : end]
        self.sent = end
        return {"content": piece} if piece else {}
