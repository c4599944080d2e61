"""Bad input is refused with a ValueError that names what is wrong, and refusing it disturbs nothing.

Requests go through LLM.generate and LLMEngine.add_request; model directories through LLM.from_hf, whose
errors are runtime.config.ModelConfigError (a ValueError).
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from warmstart.runtime import LLM, EngineOptions, LLMEngine, SamplingParams
from warmstart.runtime.models.config import ModelConfigError

ModelDir = Callable[[str], pathlib.Path]
VOCAB = 1000  # tests.support.model_configs.FAMILIES["llama"]["vocab_size"]
MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: ModelDir) -> pathlib.Path:
    return tiny_model_dir("llama")


@pytest.fixture
def llm(llama_dir: pathlib.Path) -> LLM:
    return LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)


def valid_prompts() -> list[list[int]]:
    return [[7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17], [20, 21]]


def assert_undisturbed(llm: LLM, expected: list[list[int]] | None = None) -> None:
    """Nothing was queued by the rejected request, and a valid batch still runs to completion."""
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished()
    assert stats.num_waiting == stats.num_running == stats.num_kv_blocks_used == 0
    outs = llm.generate(valid_prompts(), GREEDY)
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    assert all(o.finish_reason == "length" for o in outs)
    if expected is not None:
        assert [o.token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def expected_tokens(llama_dir: pathlib.Path) -> list[list[int]]:
    fresh = LLM.from_hf(llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    return [o.token_ids for o in fresh.generate(valid_prompts(), GREEDY)]


# -- prompts --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-string", "empty-list"])
def test_empty_prompt(llm: LLM, prompt: Any, expected_tokens: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt is empty"):
        llm.generate([prompt], GREEDY)
    assert_undisturbed(llm, expected_tokens)


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 12345, 2.0])
def test_token_id_outside_vocabulary(llm: LLM, bad: Any, expected_tokens: list[list[int]]) -> None:
    prompt = [5, 6, bad, 7]
    with pytest.raises(ValueError, match=rf"token id {bad!r} is outside the vocabulary \[0, {VOCAB}\)"):
        llm.engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[1\].*token id"):
        llm.generate([[5, 6], prompt], GREEDY)
    assert_undisturbed(llm, expected_tokens)


def test_largest_and_smallest_token_ids_are_accepted(llm: LLM) -> None:
    outs = llm.generate([[0, VOCAB - 1]], GREEDY)
    assert len(outs[0].token_ids) == 5


@pytest.mark.parametrize("prompt", [123, None, 1.5, b"bytes", {"text": "hi"}])
def test_wrong_prompt_type_to_engine(llm: LLM, prompt: Any, expected_tokens: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="prompt must be a string or a list of token ids"):
        llm.engine.add_request(prompt, GREEDY)
    assert_undisturbed(llm, expected_tokens)


@pytest.mark.parametrize("prompt", [1.5, b"bytes"])
def test_wrong_prompt_type_inside_generate_list(llm: LLM, prompt: Any) -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt must be a string or a list"):
        llm.generate([[5, 6], prompt], GREEDY)
    assert_undisturbed(llm)


@pytest.mark.parametrize("prompt", [123, None, {"text": "hi"}])
def test_wrong_prompt_type_to_generate(llm: LLM, prompt: Any) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompt, GREEDY)
    assert_undisturbed(llm)


def test_prompt_longer_than_the_context(llm: LLM, expected_tokens: list[list[int]]) -> None:
    too_long = [5] * MAX_MODEL_LEN
    message = rf"prompt is {MAX_MODEL_LEN} tokens; the context is {MAX_MODEL_LEN}.*max_model_len"
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(too_long, GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_model_len"):
        llm.generate([too_long * 2], GREEDY)
    assert_undisturbed(llm, expected_tokens)
    longest = llm.generate([[5] * (MAX_MODEL_LEN - 1)], GREEDY)[0]
    assert len(longest.token_ids) == 1 and longest.finish_reason == "length"


def test_request_larger_than_the_kv_pool(llama_dir: pathlib.Path) -> None:
    engine = LLMEngine.from_hf(llama_dir, EngineOptions(dtype="float32", num_kv_blocks=2, block_size=16))
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.add_request([5] * 20, SamplingParams(max_tokens=20))
    engine.add_request([5] * 20, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs[-1].token_ids) == 12


def test_sliding_window_request_is_refused_or_runs(tiny_model_dir: ModelDir) -> None:
    # mistral's window is 24 tokens: 4 blocks of 16 hold the window plus a chunk, not a 100-token prompt.
    engine = LLMEngine.from_hf(tiny_model_dir("mistral"), EngineOptions(dtype="float32", num_kv_blocks=4))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        engine.add_request(list(range(3, 103)), params)
    except ValueError as e:
        assert "num_kv_blocks" in str(e) or "max_num_batched_tokens" in str(e)
        return
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "accepted request never finished (stuck in the waiting queue)"


# -- sampling parameters ----------------------------------------------------------------------------------------

BAD_FIELDS: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.5),
    ("temperature", -0.1),
    ("temperature", 100.5),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("seed", "7"),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_invalid_sampling_params_at_construction(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_invalid_sampling_params_set_later_are_caught_on_submit(
    llm: LLM, field: str, value: Any, expected_tokens: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        llm.engine.add_request([5, 6, 7], params)
    with pytest.raises(ValueError, match=rf"prompts\[1\]: SamplingParams\.{field} "):
        llm.generate([[5, 6], [5, 6, 7]], [GREEDY, params])
    assert_undisturbed(llm, expected_tokens)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 0.0), ("temperature", 100.0), ("top_p", 1.0), ("top_k", -1), ("top_k", 0), ("min_p", 1.0),
     ("logprobs", 0), ("logprobs", 20), ("max_tokens", 1), ("stop", "a string")],
)
def test_boundary_sampling_params_are_accepted(field: str, value: Any) -> None:
    SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_non_numeric_float_field_names_the_field(field: str) -> None:
    kwargs: dict[str, Any] = {field: "0.5"}
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_params_of_the_wrong_type(llm: LLM) -> None:
    with pytest.raises(ValueError, match="params must be SamplingParams, got dict"):
        llm.engine.add_request([5, 6], {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"prompts\[0\]: params must be SamplingParams"):
        llm.generate([[5, 6]], [{"max_tokens": 3}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="got 2 prompts but 1 SamplingParams"):
        llm.generate([[5, 6], [7, 8]], [GREEDY])
    assert_undisturbed(llm)


# -- request ids and isolation -----------------------------------------------------------------------------------


def test_duplicate_request_id(llm: LLM) -> None:
    engine = llm.engine
    assert engine.add_request([5, 6, 7], GREEDY, request_id="dup") == "dup"
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        engine.add_request([8, 9], GREEDY, request_id="dup")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    final = [o for o in outs if o.finished]
    assert [(o.request_id, o.prompt_token_ids, len(o.token_ids)) for o in final] == [("dup", [5, 6, 7], 5)]
    assert engine.add_request([8, 9], GREEDY, request_id="dup") == "dup"  # free again once finished
    while engine.has_unfinished():
        engine.step()


def test_rejected_request_between_valid_ones_leaves_them_running(
    llm: LLM, expected_tokens: list[list[int]]
) -> None:
    engine = llm.engine
    prompts = valid_prompts()
    ids = [engine.add_request(prompts[0], GREEDY)]
    with pytest.raises(ValueError):
        engine.add_request([5, -1], GREEDY)
    ids.append(engine.add_request(prompts[1], GREEDY))
    engine.step()  # the valid ones are already running when the next bad one comes
    with pytest.raises(ValueError):
        engine.add_request([5] * MAX_MODEL_LEN, GREEDY)
    with pytest.raises(ValueError):
        engine.add_request([5, 6], GREEDY, request_id=ids[0])
    ids.append(engine.add_request(prompts[2], GREEDY))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[i] for i in ids] == expected_tokens
    assert engine.stats().num_kv_blocks_used == 0


def test_generate_with_one_bad_prompt_runs_nothing(llm: LLM, expected_tokens: list[list[int]]) -> None:
    before = llm.engine.stats()
    with pytest.raises(ValueError, match=r"prompts\[3\]: prompt token id 1000"):
        llm.generate([*valid_prompts(), [VOCAB]], GREEDY)
    after = llm.engine.stats()
    assert (after.prompt_tokens, after.generation_tokens) == (before.prompt_tokens, before.generation_tokens)
    assert llm.engine.outputs.requests == {}
    assert_undisturbed(llm, expected_tokens)


@pytest.mark.parametrize(
    ("field", "value"),
    [("dtype", "float64"), ("block_size", 0), ("max_num_seqs", 0), ("max_num_batched_tokens", 0),
     ("num_kv_blocks", 0)],
)
def test_invalid_engine_options(llama_dir: pathlib.Path, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        LLMEngine.from_hf(llama_dir, EngineOptions(**{field: value}))


# -- malformed model directories ----------------------------------------------------------------------------------


@pytest.fixture
def model_copy(llama_dir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    out = tmp_path / "model"
    shutil.copytree(llama_dir, out)
    return out


def edit_config(model_dir: pathlib.Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_weights(model_dir: pathlib.Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def assert_model_error(model_dir: pathlib.Path, *fragments: str) -> None:
    with pytest.raises(ModelConfigError) as info:
        LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=8)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def test_the_copied_model_loads(model_copy: pathlib.Path) -> None:
    """The corruptions below start from a directory that loads."""
    LLM.from_hf(model_copy, dtype="float32", num_kv_blocks=8)


def test_unsupported_architecture(model_copy: pathlib.Path) -> None:
    edit_config(model_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    assert_model_error(model_copy, "GPT2LMHeadModel", "not supported", "LlamaForCausalLM")


def test_no_config(model_copy: pathlib.Path) -> None:
    (model_copy / "config.json").unlink()
    assert_model_error(model_copy, "config.json")


def test_config_is_not_json(model_copy: pathlib.Path) -> None:
    (model_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    assert_model_error(model_copy, "config.json", "not valid JSON")


def test_config_lacks_a_required_field(model_copy: pathlib.Path) -> None:
    edit_config(model_copy, intermediate_size=None)
    assert_model_error(model_copy, "intermediate_size")


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [({"hidden_act": "gelu"}, "hidden_act"), ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
     ({"num_key_value_heads": 3}, "num_key_value_heads"), ({"mlp_bias": True}, "mlp_bias")],
)
def test_config_asks_for_an_unsupported_feature(
    model_copy: pathlib.Path, changes: dict[str, Any], fragment: str
) -> None:
    edit_config(model_copy, **changes)
    assert_model_error(model_copy, fragment)


def test_missing_tensor(model_copy: pathlib.Path) -> None:
    edit_weights(model_copy, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    assert_model_error(model_copy, "layers.1.mlp.down_proj.weight", "missing")


def test_missing_untied_lm_head(model_copy: pathlib.Path) -> None:
    edit_weights(model_copy, lambda t: t.pop("lm_head.weight"))
    assert_model_error(model_copy, "lm_head.weight", "tie_word_embeddings")


def test_tensor_of_the_wrong_shape(model_copy: pathlib.Path) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 96)

    edit_weights(model_copy, shrink)
    assert_model_error(model_copy, "layers.0.self_attn.k_proj.weight", "(48, 96)", "(96, 96)")


def test_unexpected_tensor(model_copy: pathlib.Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(96)

    edit_weights(model_copy, add)
    assert_model_error(model_copy, "unexpected", "layers.0.self_attn.o_proj.bias")


def test_no_safetensors(model_copy: pathlib.Path) -> None:
    (model_copy / "model.safetensors").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(b"not supported anyway")
    assert_model_error(model_copy, "safetensors", "pytorch_model.bin")


def test_corrupt_safetensors(model_copy: pathlib.Path) -> None:
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    assert_model_error(model_copy, "cannot read", "model.safetensors")


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}'])
def test_malformed_index(model_copy: pathlib.Path, index: str) -> None:
    (model_copy / "model.safetensors.index.json").write_text(index)
    assert_model_error(model_copy, "model.safetensors.index.json", "malformed")


@pytest.mark.parametrize("index", ['{"weight_map": []}', '{"weight_map": {"lm_head.weight": 3}}', "[]"])
def test_index_of_the_wrong_shape(model_copy: pathlib.Path, index: str) -> None:
    (model_copy / "model.safetensors.index.json").write_text(index)
    assert_model_error(model_copy, "model.safetensors.index.json", "malformed")


def test_index_names_a_missing_shard(model_copy: pathlib.Path) -> None:
    weight_map = {name: "model.safetensors" for name in load_file(model_copy / "model.safetensors")}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_model_error(model_copy, "model-00002-of-00002.safetensors", "not there")
