"""Tool-call parsers for the supported families' formats, and the grammars that force a call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from warmstart.handlers.openai.tool_calls import FORCED, call_grammar, parse_tool_calls, parser_for_template

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def calls(parser: str, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    reply = parse_tool_calls(parser, text)
    expected_id = (lambda i: len(i) == 9 and i.isalnum()) if parser == "mistral" else (lambda i: i.startswith("call_"))
    assert all(expected_id(c.id) for c in reply.tool_calls)
    return reply.content, [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def test_hermes_blocks_and_the_content_before_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    assert calls("hermes", text) == ("Let me check.",
                                     [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})])
    # A last block cut before its closing tag (the stop token ended it) still counts.
    assert calls("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}') == (None, [("get_time", {})])


def test_llama3_json_with_and_without_python_tag() -> None:
    assert calls("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}') == (
        None, [("get_weather", {"city": "Rome"})])
    two = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "arguments": {}}'
    assert calls("llama3_json", two) == (None, [("get_time", {"zone": "UTC"}), ("get_time", {})])


def test_mistral_array_and_v11_formats() -> None:
    assert calls("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]') == (
        "Sure.", [("get_weather", {"city": "Paris"})])
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    assert calls("mistral", text) == (None, [("get_weather", {"city": "Lyon"}), ("get_time", {"zone": "CET"})])


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "Just text, no call."),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("llama3_json", "The answer is {42}."),
    ("llama3_json", '{"no_name": 1}'),
    ("mistral", "[TOOL_CALLS][{broken"),
    ("json", '[{"name": "get_time", "parameters": {"zone": "UTC"}'),
    ("json", "[]"),
])  # fmt: skip
def test_text_that_is_not_a_well_formed_call_stays_content(parser: str, text: str) -> None:
    reply = parse_tool_calls(parser, text)
    assert reply.content == text and reply.tool_calls == []


def test_parser_chosen_from_the_template() -> None:
    assert parser_for_template("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template('{{ "<|python_tag|>" }}{"name": ..., "parameters": ...}') == "llama3_json"
    assert parser_for_template("{{ message.content }}") is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parse_tool_calls("nope", "")


@pytest.mark.parametrize(("parser", "good", "bad"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'),  # city is required
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}',
     '{"name": "set_alarm", "parameters": {}}'),  # not an offered function
    ("json", '[{"name": "get_weather", "parameters": {"city": "Lima", "unit": "f"}}, '
             '{"name": "get_time", "parameters": {"zone": "UTC"}}]',
     '[{"name": "get_weather", "parameters": {"unit": "c"}}]'),  # city is required
])  # fmt: skip
def test_call_grammar_admits_valid_calls_only(tiny_model_dir, parser: str, good: str, bad: str) -> None:  # type: ignore[no-untyped-def]
    import llguidance

    from warmstart.runtime.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir("llama"))
    lt = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=[2])
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(parser, [WEATHER, TIME]))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    for text, admitted in ((good, True), (bad, False)):
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()
        assert ok is admitted, text
        assert parse_tool_calls(parser, text).tool_calls or not admitted


def test_named_function_grammar_and_unenforced_format() -> None:
    assert '"get_time"' in call_grammar("hermes", [WEATHER, TIME], name="get_time")
    assert '"get_weather"' not in call_grammar("hermes", [WEATHER, TIME], name="get_time")
    with pytest.raises(ValueError, match="no offered function is named"):
        call_grammar("hermes", [WEATHER], name="get_time")
    with pytest.raises(ValueError, match="not enforced"):
        call_grammar("nope", [WEATHER])


@pytest.fixture(scope="module")
def mistral_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, int]:
    from tests.support.mistral_model import mistral_tool_model_dir
    from warmstart.runtime.tokenizer import Tokenizer

    model, token_id = mistral_tool_model_dir(tmp_path_factory.mktemp("mistral"))
    return Tokenizer(model), token_id


def test_mistral_calls_read_from_text_that_keeps_the_special_token(mistral_tokenizer: tuple[Any, int]) -> None:
    tok, token_id = mistral_tokenizer
    body = tok.encode('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', add_special_tokens=False)
    ids = [*tok.encode("Checking.", add_special_tokens=False), token_id, *body]
    kept = tok.decode(ids, skip_special_tokens=False)
    assert calls("mistral", kept) == ("Checking.", [("get_time", {"zone": "UTC"})])
    assert calls("mistral", tok.decode(ids))[1] == []  # the token skipped, nothing marks the call


@pytest.mark.parametrize(("text", "parallel", "admitted"), [
    ('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', False, True),
    ('[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     True, True),
    ('[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     False, False),  # one call only
    ('[{"name": "get_weather", "arguments": {"unit": "c"}}]', True, False),  # city is required
])  # fmt: skip
def test_mistral_grammar_begins_with_the_special_token(mistral_tokenizer: tuple[Any, int], text: str,
                                                        parallel: bool, admitted: bool) -> None:
    import llguidance

    tok, token_id = mistral_tokenizer
    lt = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=[2])
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar("mistral", [WEATHER, TIME], parallel=parallel,
                                                                  mistral_token_id=token_id))
    body = tok.encode(text, add_special_tokens=False)
    without_token = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not without_token.consume_tokens(body)  # the call must open with the token itself
    matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert (matcher.consume_tokens([token_id, *body]) and matcher.is_accepting()) is admitted


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", 'Checking.  \n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'),
    ("hermes", "No call here, just < and <tool text."),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    ("llama3_json", "Plain words."),
    ("mistral", 'Ok [TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
    ("json", '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_time", "parameters": {}}]'),
])  # fmt: skip
@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_reply(parser: str, text: str, cut: int) -> None:
    from warmstart.handlers.openai.tool_calls import ToolCallStream

    stream = ToolCallStream(parser)
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    deltas = [stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    whole = parse_tool_calls(parser, text)
    assert "".join(d.get("content", "") for d in deltas) == (whole.content or "")
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (c.name, c.arguments) for c in whole.tool_calls]
    assert all("tool_calls" not in d for d in deltas[:-1])


def test_a_template_without_a_known_format_needs_the_flag() -> None:
    from warmstart.handlers.openai.tool_calls import ToolFieldError, tool_request

    body = {"tools": [WEATHER], "tool_choice": "auto"}
    with pytest.raises(ToolFieldError, match=r"--tool-call-parser .* or send tool_choice \"required\" or a named"):
        tool_request(body, "{{ messages }}", None)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = tool_request({**body, "tool_choice": choice}, "{{ messages }}", None)
        assert forced is not None and forced.parser == FORCED and forced.grammar is not None
    request = tool_request(body, "{{ messages }}", "hermes")
    assert request is not None and request.parser == "hermes" and request.grammar is None
    assert tool_request({"tools": [WEATHER], "tool_choice": "none"}, "{{ messages }}", None).parser is None  # type: ignore[union-attr]


def test_forced_calls_are_compact_json(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    import llguidance

    from warmstart.runtime.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir("llama"))
    lt = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=[2])
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar("hermes", [TIME]))
    for spaces, admitted in (("", True), ("  ", False)):
        text = f'<tool_call>\n{{{spaces}"name": "get_time", "arguments": {{"zone": "UTC"}}}}\n</tool_call>'
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        consumed = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
        assert (consumed and matcher.is_accepting()) is admitted


def test_mistral_calls_go_back_through_mistrals_template_in_the_next_turn() -> None:
    from pathlib import Path

    from warmstart.runtime.chat_template import render

    template = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "mistral.jinja").read_text()
    reply = parse_tool_calls("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    (call,) = reply.tool_calls
    assert len(call.id) == 9 and call.id.isalnum()
    history = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call.openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    text = render(template, history, bos_token="<s>", eos_token="</s>")
    assert f'"call_id": "{call.id}"' in text
