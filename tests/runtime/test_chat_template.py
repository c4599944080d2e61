"""Chat templates render as transformers' apply_chat_template renders them: the same text and the same token ids,
for the real templates of Llama 3.1 / 3.2, Qwen2.5, Qwen3, Mistral (Nemo) and SmolLM2 (tests/fixtures), with
tools, documents and template keyword arguments; runtime/ itself never imports transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from warmstart.runtime.chat_template import ChatTemplateError, render
from warmstart.runtime.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TEMPLATES = sorted(p.stem for p in FIXTURES.glob("*.jinja"))

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now & <soon>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                   "required": ["city"]}}}
CHATS: dict[str, list[dict[str, Any]]] = {
    "one_turn": [{"role": "user", "content": "Hello there!"}],
    "system_and_turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 7 + 5?"},
        {"role": "assistant", "content": "12."},
        {"role": "user", "content": "And 7 * 5? Answer with <b>bold</b> & \"quotes\"."},
    ],
}
KWARGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "tools": {"tools": [WEATHER]},
    "documents": {"documents": [{"title": "Fox", "text": "The quick brown fox."}]},
    "no_thinking": {"enable_thinking": False},
    "thinking": {"enable_thinking": True},
}


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """The tiny models' tokenizer with each fixture template, as a directory both tokenizers load."""
    dirs = {}
    for name in TEMPLATES:
        out = tmp_path_factory.mktemp(f"tmpl-{name}")
        src = tiny_model_dir("llama")
        shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
        config = json.loads((src / "tokenizer_config.json").read_text())
        config.update(chat_template=(FIXTURES / f"{name}.jinja").read_text(), bos_token="<|endoftext|>",
                      eos_token="<|im_end|>")
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        dirs[name] = out
    return dirs


def reference(model_dir: Path, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    if not isinstance(ids, list):  # a BatchEncoding
        ids = ids["input_ids"]
    return text, list(ids)


@pytest.mark.parametrize("kwargs", list(KWARGS), ids=list(KWARGS))
@pytest.mark.parametrize("chat", list(CHATS), ids=list(CHATS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_rendering_equals_transformers(model_dirs: dict[str, Path], name: str, chat: str, kwargs: str) -> None:
    messages, extra = CHATS[chat], KWARGS[kwargs]
    ours = Tokenizer(model_dirs[name])
    text, ids = reference(model_dirs[name], messages, **extra)
    assert ours.apply_chat_template(messages, **extra) == text
    assert ours.encode_chat(messages, **extra) == ids


TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "llama-3.1"])
def test_tool_call_turns_render_as_transformers_does(model_dirs: dict[str, Path], name: str) -> None:
    text, ids = reference(model_dirs[name], TOOL_TURNS, tools=[WEATHER])
    ours = Tokenizer(model_dirs[name])
    assert ours.apply_chat_template(TOOL_TURNS, tools=[WEATHER]) == text
    assert ours.encode_chat(TOOL_TURNS, tools=[WEATHER]) == ids


def test_enable_thinking_reaches_the_template(model_dirs: dict[str, Path]) -> None:
    qwen3 = Tokenizer(model_dirs["qwen3"])
    messages = CHATS["one_turn"]
    assert qwen3.apply_chat_template(messages, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in qwen3.apply_chat_template(messages)


def test_a_template_refusing_the_conversation_is_a_chat_template_error(model_dirs: dict[str, Path]) -> None:
    mistral = Tokenizer(model_dirs["mistral"])
    with pytest.raises(ChatTemplateError, match="alternate"):
        mistral.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_the_environment_has_transformers_extensions() -> None:
    source = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson(indent=1, "
              "separators=(',', ':'), sort_keys=true) }}{% endfor %}{% generation %}[{{ x }}]{% endgeneration %}"
              "{% set ns = namespace(n=1) %}{{ ns.n }}{{ strftime_now('%Y')|length }}")
    out = render(source, [{"role": "u", "content": "<&>"}, {"role": "v", "content": "no"}], x="kw")
    assert out == '{\n "content":"<&>",\n "role":"u"\n}[kw]14'
    with pytest.raises(Exception, match="underscore"):
        render("{% set ns = namespace() %}{% set ns._x = 1 %}", [])
