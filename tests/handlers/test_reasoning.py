"""handlers/openai/reasoning.py: the qwen3 and deepseek_r1 splits of a reply, and streamed deltas that add up to them
however the text is cut."""

from __future__ import annotations

import random

import pytest

from warmstart.handlers.openai.reasoning import ReasoningStream, Split, message_fields, split


@pytest.mark.parametrize(("parser", "text", "expected"), [
    ("qwen3", "<think>\nhmm</think>\n\nAnswer", Split("\nhmm", "\n\nAnswer")),
    ("qwen3", "Answer without thinking", Split("", "Answer without thinking")),
    ("qwen3", "\n<think>cut off by max_tokens", Split("cut off by max_tokens", "")),
    ("qwen3", "a < b and </thin", Split("", "a < b and </thin")),
    ("deepseek_r1", "hmm, the template opened it</think>Answer", Split("hmm, the template opened it", "Answer")),
    ("deepseek_r1", "<think>hmm</think>Answer", Split("hmm", "Answer")),
    ("deepseek_r1", "still thinking", Split("still thinking", "")),
])
def test_whole_replies_split(parser: str, text: str, expected: Split) -> None:
    assert split(parser, text) == expected


def test_message_fields() -> None:
    assert message_fields(None, "<think>x</think>y") == {"content": "<think>x</think>y"}
    assert message_fields("qwen3", "<think>x</think>y") == {"content": "y", "reasoning_content": "x", "reasoning": "x"}
    assert message_fields("qwen3", "y") == {"content": "y", "reasoning_content": None, "reasoning": None}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", ["<think>\nlet me see: 7 + 5 < 13</think>\n\n12.", "<think>a</thi", "12, no thought",
                                  "  <think></think>x", "<th", "x</think>y</think>z"])
def test_streamed_deltas_add_up_to_the_whole_split(parser: str, text: str) -> None:
    rnd = random.Random(0)
    for _ in range(50):
        cuts = sorted(rnd.sample(range(1, len(text)), k=rnd.randrange(0, min(6, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ReasoningStream(parser)
        deltas = [stream.delta_fields(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        whole = split(parser, text)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.reasoning, pieces
        assert "".join(d.get("content", "") for d in deltas) == whole.content, pieces
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
