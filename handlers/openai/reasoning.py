"""`--reasoning-parser`: a reasoning model's thinking split out of its answer, as vLLM's reasoning parsers split it.

The text between `<think>` and `</think>` becomes the message's `reasoning_content` (and each chunk's
`delta.reasoning_content` when streaming), the rest its `content`. The two parsers differ in a reply without
`</think>`:

- `qwen3`: the thinking must open with `<think>`; a reply that does not (thinking turned off with
  `chat_template_kwargs: {"enable_thinking": false}`, which makes Qwen3's template write an empty think block into
  the prompt) is all content.
- `deepseek_r1`: DeepSeek-R1's template opens the think block in the prompt, so the reply is reasoning until
  `</think>`, whether or not it repeats `<think>`.

A reply cut off inside its thinking (max_tokens) is reasoning with no content, whole or streamed alike (vLLM's
qwen3 parser calls it content when whole). The split is on text; a model whose think tags are special tokens that
decoding skips has nothing to split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


def split(parser: str, text: str, final: bool = True) -> Split:
    """``text`` (a whole reply, or what has come of it when ``final`` is false) as reasoning and content. While
    not final, whatever could still turn out to be part of a tag is held back in neither, so that the split of a
    longer text only ever extends the split of a shorter one."""
    body = text.lstrip()
    if body.startswith(START):
        return _after_start(body[len(START):], final)
    if not final and START.startswith(body):  # "", "<", "<th"...: the reply may still open a think block
        return Split("", "")
    if parser == "deepseek_r1":
        return _after_start(text, final)
    return Split("", text)


def _after_start(rest: str, final: bool) -> Split:
    reasoning, found, content = rest.partition(END)
    if found:
        return Split(reasoning, content)
    if not final:
        reasoning = reasoning[: len(reasoning) - _partial_tag(reasoning)]
    return Split(reasoning, "")


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` could begin END."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-n:]):
            return n
    return 0


def message_fields(parser: str | None, text: str) -> dict[str, Any]:
    """The message's content (and reasoning_content, with a parser) of a whole reply. vLLM names the field
    `reasoning_content` (its newer versions `reasoning`): both are sent."""
    if parser is None:
        return {"content": text}
    parts = split(parser, text)
    reasoning = parts.reasoning or None
    return {"content": parts.content or None, "reasoning_content": reasoning, "reasoning": reasoning}


class ReasoningStream:
    """One streamed choice's text, split as it comes: each call returns the new reasoning and content."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = Split("", "")

    def delta_fields(self, new_text: str, finished: bool) -> dict[str, Any]:
        self.text += new_text
        now = split(self.parser, self.text, final=finished)
        reasoning, content = now.reasoning[len(self.sent.reasoning):], now.content[len(self.sent.content):]
        self.sent = now
        fields: dict[str, Any] = {}
        if reasoning:
            fields["reasoning_content"] = fields["reasoning"] = reasoning
        if content or not reasoning:
            fields["content"] = content
        return fields
