"""OpenAI's Responses API (POST /v1/responses, the Agents SDK's default call): the request in, the reply out.

A Responses request becomes a chat completions body (``input`` the messages, ``instructions`` a system message
in front, ``max_output_tokens`` max_tokens, the sampling fields as they are), which the chat parser validates and
tokenizes. The reply is built from the engine's RequestOutputs as chat's is (openai/replies.py): a Response
object, or the Responses event sequence (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done, response.completed). Text in, text out: no stored
responses, no built-in tools; with --reasoning-parser the reasoning is left out of the output text.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from warmstart.handlers.openai.reasoning import ReasoningStream, message_fields
from warmstart.handlers.openai.replies import best, usage
from warmstart.handlers.openai.requests import Generation, ServedModel, bad, json_type

if TYPE_CHECKING:
    from warmstart.runtime.outputs import RequestOutput

# Responses fields with no effect on what this server generates: dropped before the chat parser sees the body.
IGNORED = {"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
           "truncation", "include", "parallel_tool_calls", "reasoning", "max_tool_calls", "stream_options", "user"}
# Fields that ask for what this server does not do: refused unless at a value that asks for nothing.
REFUSED = {
    "previous_response_id": "this server stores no responses; send the whole conversation in input",
    "conversation": "this server stores no conversations; send the whole conversation in input",
    "prompt": "this server has no stored prompt templates; send the text in instructions and input",
    "background": "this server answers in the foreground only; leave background out",
    "tools": "tools are not supported on /v1/responses; leave tools out",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; use /v1/chat/completions for logprobs",
    "n": "a Response has one output; use /v1/chat/completions for several choices",
}
NEUTRAL = {"background": False, "tools": [], "top_logprobs": 0, "n": 1}
TEXT_PARTS = {"input_text", "output_text", "text"}
ROLES = {"user", "assistant", "system", "developer"}


@dataclass
class ResponsesCall:
    """One /v1/responses request: the chat completions body it becomes, and what its Response object echoes."""

    chat: dict[str, Any]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: Any
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))


def to_chat(body: Any) -> ResponsesCall:
    """The chat completions body for a Responses request; a 400 naming the field for what cannot be served."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {json_type(body)}")
    for name, why in REFUSED.items():
        if body.get(name) is not None and body[name] != NEUTRAL.get(name):
            raise bad(f"{name}: {why}", name)
    _check_tool_choice(body.get("tool_choice"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad(f"instructions must be a string, got {json_type(instructions)}", "instructions")
    messages = _messages(body.get("input"))
    if instructions:
        messages = [{"role": "system", "content": instructions}, *messages]
    chat = {k: v for k, v in body.items()
            if k not in IGNORED and k not in REFUSED and k not in ("input", "instructions", "max_output_tokens", "text",
                                                                    "tool_choice")}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return ResponsesCall(chat, instructions, _int(body.get("max_output_tokens")),
                         _num(body.get("temperature")), _num(body.get("top_p")), body.get("metadata"))


def _check_tool_choice(choice: Any) -> None:
    if choice is not None and choice not in ("none", "auto"):
        raise bad("tool_choice: tools are not supported on /v1/responses; leave tool_choice out", "tool_choice")


def _messages(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        raise bad("input is required: a string, or an array of messages", "input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad(f"input must be a string or a non-empty array of messages, got {json_type(raw)}", "input")
    return [_message(item, f"input[{i}]") for i, item in enumerate(raw)]


def _message(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise bad(f"{where} must be a message object ({{role, content}}), got {json_type(item)}", "input")
    kind = item.get("type", "message")
    if kind != "message":
        raise bad(f"{where} is a {json.dumps(kind)[:40]} item; this server takes message items only (text in, "
                  "text out: no tool calls, no reasoning items)", "input")
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of user, assistant, system, developer, got {json.dumps(role)[:40]}",
                  "input")
    return {"role": role, "content": _text(item.get("content"), where)}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of text parts, got {json_type(content)}", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else json_type(part)
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{where}.content[{j}] must be a text part ({{type: input_text, text: ...}}); this server "
                      f"takes text only, got {json.dumps(kind)[:40]}", "input")
        texts.append(part["text"])
    return "".join(texts)


def _response_format(text: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format (which says whether it is supported); plain text is no format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad(f"text must be an object ({{format: ...}}), got {json_type(text)}", "text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt if isinstance(fmt, dict) else {"type": fmt}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


# -- replies -------------------------------------------------------------------------------------------------


@dataclass
class ResponsesReply:
    """Builds one /v1/responses reply from the engine's outputs: the Response, or its stream of events."""

    call: ResponsesCall
    gen: Generation
    model: ServedModel
    text: list[str] = field(default_factory=list)  # the output text streamed so far
    reasoning: ReasoningStream | None = None
    sequence: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.model.reasoning_parser is not None:
            self.reasoning = ReasoningStream(self.model.reasoning_parser)

    @property
    def model_name(self) -> str:
        return self.gen.model_name or self.model.name

    def whole(self, outs: RequestOutput | list[RequestOutput]) -> dict[str, Any]:
        outs = outs if isinstance(outs, list) else [outs]
        out = best(outs, 1)[0]
        text = message_fields(self.model.reasoning_parser, out.text)["content"] or ""
        return self._response(text, out.finish_reason, usage(outs))

    def opening(self) -> list[bytes]:
        started = self._response(None, None, None)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
                self._event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
                self._event("response.content_part.added", part=output_text(""), **self._where)]

    def delta(self, out: RequestOutput) -> list[bytes]:
        new = out.new_text
        if self.reasoning is not None:
            new = self.reasoning.delta_fields(new, out.finished).get("content") or ""
        if not new:
            return []
        self.text.append(new)
        return [self._event("response.output_text.delta", delta=new, logprobs=[], **self._where)]

    def closing(self, last: RequestOutput) -> list[bytes]:
        full = "".join(self.text)
        status = "incomplete" if last.finish_reason == "length" else "completed"
        # Always response.completed (its status says incomplete), as vLLM does: clients wait for that event.
        return [self._event("response.output_text.done", text=full, logprobs=[], **self._where),
                self._event("response.content_part.done", part=output_text(full), **self._where),
                self._event("response.output_item.done", output_index=0, item=self._message(full, status)),
                self._event("response.completed", response=self._response(full, last.finish_reason, usage(last)))]

    def error(self, body: dict[str, Any]) -> bytes:
        """The engine stopped mid-stream: the Responses error event (nothing comes after it)."""
        error = body["error"]
        return self._event("error", code=error.get("code"), message=error["message"], param=error.get("param"))

    @property
    def _where(self) -> dict[str, Any]:
        return {"item_id": self.call.message_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": next(self.sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def _response(self, text: str | None, finish_reason: str | None, used: dict[str, Any] | None) -> dict[str, Any]:
        """The Response: in progress (text None), or done with its one assistant message."""
        call, done = self.call, text is not None
        incomplete = finish_reason == "length"
        status = "in_progress" if not done else "incomplete" if incomplete else "completed"
        output = [self._message(text or "", "incomplete" if incomplete else "completed")] if done else []
        return {
            "id": call.id, "object": "response", "created_at": call.created_at, "status": status,
            "completed_at": int(time.time()) if done else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": call.instructions, "max_output_tokens": call.max_output_tokens, "model": self.model_name,
            "output": output, "parallel_tool_calls": False, "previous_response_id": None, "reasoning": None,
            "store": False, "temperature": call.temperature, "top_p": call.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "truncation": "disabled",
            "metadata": call.metadata or {}, "usage": responses_usage(used) if used else None,
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {"id": self.call.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [output_text(text)] if status != "in_progress" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def responses_usage(used: dict[str, Any]) -> dict[str, Any]:
    cached = (used.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": used["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": used["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": used["total_tokens"]}
