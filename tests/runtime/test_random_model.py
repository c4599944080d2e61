"""The random model builder writes directories that transformers loads as the model the config describes."""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.model_configs import FAMILIES
from warmstart.runtime.random_model import CHATML_TEMPLATE, SPECIAL_TOKENS, _param_specs, make_random_model

transformers = pytest.importorskip("transformers")

NAMES = sorted(FAMILIES)
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea"
ModelDir = Callable[[str], pathlib.Path]


def _load(path: pathlib.Path) -> tuple[Any, dict[str, list[str]]]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, dtype=torch.float32
    )
    return model.eval(), info


def _state(path: pathlib.Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return _experts_stacked(tensors)


# The hub's MoE checkpoints hold one tensor per expert and matrix; transformers stacks them as it loads
_EXPERT = re.compile(r"(?P<layer>model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\."
                     r"(?:gate\.weight|experts\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight)$")


def _experts_stacked(named: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint names (and tensors, or shapes) as transformers' model has them: experts stacked into
    mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I], Mixtral's block_sparse_moe as mlp."""
    out, experts = {}, {}
    for name, value in named.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = value
        elif m["e"] is None:
            out[f"{m['layer']}.mlp.gate.weight"] = value
        else:
            experts.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[m["w"]] = value
    for layer, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        parts = [(x.get("gate_proj", x.get("w1")), x.get("up_proj", x.get("w3")), x.get("down_proj", x.get("w2")))
                 for x in ordered]
        if isinstance(parts[0][0], torch.Tensor):
            out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in parts])
            out[f"{layer}.mlp.experts.down_proj"] = torch.stack([d for _, _, d in parts])
        else:  # shapes
            (gate, hidden), (down_out, inter) = parts[0][0], parts[0][2]
            out[f"{layer}.mlp.experts.gate_up_proj"] = (len(parts), 2 * gate, hidden)
            out[f"{layer}.mlp.experts.down_proj"] = (len(parts), down_out, inter)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_every_weight_and_nothing_else(tiny_model_dir: ModelDir, name: str) -> None:
    model, info = _load(tiny_model_dir(name))
    assert info["missing_keys"] == [] or set(info["missing_keys"]) == set(), info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    cfg = FAMILIES[name]
    assert type(model).__name__ == cfg["architectures"][0]
    written = _state(tiny_model_dir(name))
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and cfg["tie_word_embeddings"]:
            assert "lm_head.weight" not in written
            assert torch.equal(tensor, written["model.embed_tokens.weight"])
        else:
            assert torch.equal(tensor, written[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_norm_weights_are_not_all_one(tiny_model_dir: ModelDir, name: str) -> None:
    for key, tensor in _state(tiny_model_dir(name)).items():
        if key.endswith("norm.weight"):
            assert not torch.all(tensor == 1.0), key


def test_qwen3_has_qk_norm_of_head_dim_and_qwen2_has_qkv_bias(tiny_model_dir: ModelDir) -> None:
    q3 = _state(tiny_model_dir("qwen3"))
    assert q3["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert q3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    q2 = _state(tiny_model_dir("qwen2"))
    assert "model.layers.1.self_attn.k_proj.bias" in q2
    assert "model.layers.1.self_attn.o_proj.bias" not in q2


def test_two_shards_load_to_the_same_weights(tiny_model_dir: ModelDir, tmp_path: pathlib.Path) -> None:
    path = make_random_model(tmp_path, FAMILIES["llama"], seed=0, num_shards=2)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    model, info = _load(path)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    single = _state(tiny_model_dir("llama"))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, single[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_round_trips_and_matches_tokenizers_library(tiny_model_dir: ModelDir, name: str) -> None:
    from tokenizers import Tokenizer

    path = tiny_model_dir(name)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert len(tok) == min(FAMILIES[name]["vocab_size"], 2048) == raw.get_vocab_size()
    texts = [PROMPT, "Numbers 12345 and\n\n  spaces\ttabs!", "héllo wörld, 日本語 🙂"]
    texts.append("<|im_start|>user\nhi<|im_end|>")
    for text in texts:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok("<|im_start|>").input_ids == [1]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_chat_template_renders_chatml(tiny_model_dir: ModelDir, name: str) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir(name))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\n"
    assert tok.chat_template == CHATML_TEMPLATE


def test_special_token_ids_follow_the_documented_rule(tmp_path: pathlib.Path) -> None:
    big_ids = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    cfg = {**FAMILIES["qwen2"], **big_ids}
    path = make_random_model(tmp_path, cfg)
    written = json.loads((path / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (0, 2)
    assert "pad_token_id" not in written
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert (tok.bos_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 2)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_logits_are_well_separated_and_do_not_collapse(tiny_model_dir: ModelDir, name: str) -> None:
    path = tiny_model_dir(name)
    model, _ = _load(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    gaps = torch.tensor([(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores])
    assert (gaps > 1e-2).float().mean() >= 0.85, gaps
    assert gaps.median() > 0.1, gaps
    generated = out.sequences[0, ids.shape[1]:].tolist()
    assert len(set(generated)) >= 10, generated
    assert len(set(generated[:8])) >= 4, generated


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: pathlib.Path) -> None:
    a = make_random_model(tmp_path / "a", FAMILIES["qwen3"], seed=7)
    b = make_random_model(tmp_path / "b", FAMILIES["qwen3"], seed=7)
    c = make_random_model(tmp_path / "c", FAMILIES["qwen3"], seed=8)
    for f in ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"]:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert wa.keys() == wc.keys()
    assert all(not torch.equal(wa[k], wc[k]) for k in wa)


def test_bfloat16_and_smaller_tokenizer_vocab(tmp_path: pathlib.Path) -> None:
    path = make_random_model(tmp_path, FAMILIES["mistral"], dtype="bfloat16", vocab_size_tokenizer=300)
    weights = load_file(path / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert weights["model.embed_tokens.weight"].shape == (800, 64)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == 300


def test_param_specs_match_a_transformers_model_built_from_config() -> None:
    for name, cfg in FAMILIES.items():
        config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if cfg["tie_word_embeddings"]:
            expected.pop("lm_head.weight")
        ours = _experts_stacked({p.name: p.shape for p in _param_specs(cfg, cfg["architectures"][0])})
        assert ours == expected, name


@pytest.mark.parametrize("bad", [
    {"architectures": ["GPT2LMHeadModel"], "vocab_size": 10},
    {"architectures": ["LlamaForCausalLM"], "hidden_size": 8},
])
def test_bad_configs_are_rejected_with_a_message(tmp_path: pathlib.Path, bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="unsupported architecture|lacks"):
        make_random_model(tmp_path, bad)


def test_command_line(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from warmstart.runtime.random_model import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(FAMILIES["qwen3"]))
    assert main([str(cfg), str(tmp_path / "out"), "--seed", "3", "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert main([str(tmp_path / "missing.json"), str(tmp_path / "out2")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_sliding_window_shows_keys_with_i_minus_j_below_window(tmp_path: pathlib.Path, attn: str) -> None:
    """The reference semantic our engine must match: key j is visible from query i iff 0 <= i - j < W."""
    window = FAMILIES["mistral"]["sliding_window"]
    path = make_random_model(tmp_path, {**FAMILIES["mistral"], "num_hidden_layers": 1})
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    ids = torch.arange(3, 3 + 40).unsqueeze(0)
    i = 35
    with torch.no_grad():
        base = model(ids).logits[0, i]
        for j, visible in [(i - window + 1, True), (i - window, False)]:
            changed = ids.clone()
            changed[0, j] = 500
            assert (not torch.allclose(model(changed).logits[0, i], base)) == visible, (j, visible)


def test_ids_past_the_tokenizer_vocab_are_unlikely(tmp_path: pathlib.Path) -> None:
    path = make_random_model(tmp_path, FAMILIES["llama"], vocab_size_tokenizer=300)
    model, _ = _load(path)
    with torch.no_grad():
        logits = model(torch.arange(3, 60).unsqueeze(0)).logits[0]
    assert bool((logits.argmax(-1) < 300).all())
