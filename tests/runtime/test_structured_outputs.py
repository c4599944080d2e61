"""Structured outputs in the engine: a random model's garbage is forced into the schema, regex or choice, row by
row, while free requests in the same batch sample exactly as they would alone."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from typing import Any

import jsonschema
import pytest

from tests.support.schemas import PERSON_SCHEMA
from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.engine.structured import GrammarError, check_grammar
from warmstart.runtime.structured_outputs import StructuredOutputsParams

# Nested objects, arrays, enums and required fields, every string and number bounded so that a random model
# (which almost never picks a closing quote) finishes within max_tokens.
PROMPT = "Describe a person as JSON:"


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:  # type: ignore[no-untyped-def]
    return LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=256, max_model_len=512, seed=0)


def params(spec: StructuredOutputsParams | None, seed: int, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(max_tokens=200, temperature=temperature, seed=seed, structured_outputs=spec)


def test_json_schema_output_parses_and_validates(llm: LLM) -> None:
    spec = StructuredOutputsParams(json=PERSON_SCHEMA)
    outs = llm.generate([PROMPT] * 4, [params(spec, seed) for seed in range(3)] + [params(spec, 0, 0.0)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)


def test_unconstrained_random_model_does_not_produce_json(llm: LLM) -> None:
    """The control: without the grammar the same requests are garbage, so the test above proves the constraint."""
    outs = llm.generate([PROMPT] * 3, [params(None, seed) for seed in range(3)])
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_json_object_regex_and_choice(llm: LLM) -> None:
    specs = [StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
             StructuredOutputsParams(choice=["yes", "no", "maybe so"])]
    # Greedy for the object: its keys are free strings, which a random model's samples seldom close in time.
    obj, regex, choice = llm.generate([PROMPT] * 3, [params(s, 1, 0.0 if s.json_object else 1.0) for s in specs])
    assert isinstance(json.loads(obj.text), dict) and obj.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", regex.text), regex.text
    assert choice.text in ("yes", "no", "maybe so") and choice.finish_reason == "stop"


def test_a_long_choice_list_is_followed(llm: LLM) -> None:
    """Past llguidance's 2,000 parser items a row: a list of one rule per choice errored at the first token, and the
    request ended after one character that matched no choice."""
    for choices in ([f"label {i}" for i in range(3000)], ["a", "ab", "abc"]):  # also choices prefixes of others
        outs = llm.generate([PROMPT] * 4, [params(StructuredOutputsParams(choice=choices), seed) for seed in range(4)])
        assert all(out.text in choices and out.finish_reason == "stop" for out in outs), [o.text for o in outs]


def test_free_rows_sample_as_alone_when_batched_with_constrained_ones(llm: LLM) -> None:
    free = [params(None, seed) for seed in (5, 6)]
    alone = [out.token_ids for out in llm.generate([PROMPT, "Another prompt"], free)]
    spec = StructuredOutputsParams(json=PERSON_SCHEMA)
    mixed = llm.generate([PROMPT, PROMPT, "Another prompt", PROMPT],
                         [free[0], params(spec, 7), free[1], params(spec, 8)])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    for out in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)


def test_too_few_tokens_end_with_length(llm: LLM) -> None:
    spec = StructuredOutputsParams(json=PERSON_SCHEMA)
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=5, seed=0, structured_outputs=spec))
    assert out.finish_reason == "length" and out.text.startswith("{")


def test_compiled_grammars_are_cached_by_schema(llm: LLM) -> None:
    compiler = llm.engine.inputs.grammar_compiler()
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}
    compiled = compiler.stats.compiled
    first = compiler.compile(StructuredOutputsParams(json=schema))
    # The same schema as JSON text with its keys in another order: the same compiled grammar.
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(dict(reversed(schema.items())))))
    assert again is first and compiler.stats.compiled == compiled + 1
    assert compiler.compile(StructuredOutputsParams(json={**schema, "required": []})) is not first
    (out,) = llm.generate(PROMPT, params(StructuredOutputsParams(json=schema), 0))
    assert json.loads(out.text) in ({"x": 1}, {"x": 2}) and compiler.stats.compiled == compiled + 2


@pytest.mark.parametrize(("spec", "problem"), [
    (StructuredOutputsParams(json={"type": "foo"}), "Invalid type: foo"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "/nope"),
    (StructuredOutputsParams(regex="a(b"), "unclosed group"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
])  # fmt: skip
def test_invalid_grammars_are_refused_naming_the_problem(llm: LLM, spec: StructuredOutputsParams,
                                                         problem: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(problem)):
        check_grammar(spec)
    with pytest.raises(ValueError, match=re.escape(problem)):
        llm.generate(PROMPT, params(spec, 0))


def test_structured_outputs_params_need_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_constrained_rows_do_not_speculate_and_stay_valid(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model_dir = tiny_model_dir("llama")
    # The model as its own draft: every proposal of a free row is accepted, so speculation surely runs.
    llm = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=256, max_model_len=512, seed=0,
                      speculative="draft", draft_model=model_dir)
    spec = StructuredOutputsParams(json=PERSON_SCHEMA)
    free, constrained = llm.generate([PROMPT, PROMPT], [params(None, 0, 0.0), params(spec, 0, 0.0)])
    jsonschema.validate(json.loads(constrained.text), PERSON_SCHEMA)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0  # the free row speculated
    # Only it did: a verification counts all it emitted, even past the token that stopped the request (k = 4).
    assert stats.spec_num_emitted_tokens <= len(free.token_ids) + 4 < len(free.token_ids) + len(constrained.token_ids)


def test_the_grammar_engine_is_imported_only_for_a_constrained_request() -> None:
    code = "import sys, warmstart.runtime, warmstart.runtime.engine.engine; print('llguidance' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_async_requests_compile_off_the_step_loop(tiny_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from warmstart.runtime import AsyncLLM
    from warmstart.runtime.engine.options import EngineOptions
    from warmstart.runtime.engine.structured import GrammarCompiler

    threads: list[str] = []
    compile = GrammarCompiler.compile

    def recording(self: GrammarCompiler, spec: StructuredOutputsParams) -> Any:
        before = self.stats.compiled
        result = compile(self, spec)
        if self.stats.compiled > before:  # a miss: really compiled
            threads.append(threading.current_thread().name)
        return result

    monkeypatch.setattr(GrammarCompiler, "compile", recording)
    llm = AsyncLLM.from_hf(tiny_model_dir("llama"), EngineOptions(dtype="float32", num_kv_blocks=64, max_model_len=256))

    async def run() -> str:
        spec = StructuredOutputsParams(regex="[a-c]{4}-async")
        async for out in llm.generate(PROMPT, SamplingParams(max_tokens=20, structured_outputs=spec)):
            text = out.text
        return text

    try:
        assert re.fullmatch("[a-c]{4}-async", asyncio.run(run()))
    finally:
        llm.shutdown()
    assert len(threads) == 1 and threads[0] != "warmstart-engine"


def test_a_costly_regex_does_not_stall_the_other_streams(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Issue 40, 5: eight requests with (x{1000}){1000} held other streams for 4.4 s, each first mask about 1 s
    inside the shared step. The grammar engine's lexer fuel is bounded and the first mask is computed where the
    grammar compiles, off the step: the free stream's tokens keep coming (a generous bound: the stall was seconds)."""
    import time

    from warmstart.runtime import AsyncLLM
    from warmstart.runtime.engine.options import EngineOptions

    options = EngineOptions(dtype="float32", num_kv_blocks=256, max_model_len=256)
    llm = AsyncLLM.from_hf(tiny_model_dir("llama"), options)
    gaps: list[float] = []

    async def free() -> None:
        last = time.monotonic()
        async for _ in llm.generate(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True)):
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def costly(i: int) -> str:
        spec = StructuredOutputsParams(regex=f"(x{{{1000 + i}}}){{1000}}")  # each its own grammar: no cache hits
        text = ""
        async for out in llm.generate(PROMPT, SamplingParams(max_tokens=5, structured_outputs=spec)):
            text = out.text
        return text

    async def run() -> None:
        await asyncio.gather(free(), *(costly(i) for i in range(8)), return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
    assert len(gaps) == 60 and max(gaps[1:]) < 0.5, sorted(gaps)[-3:]
