"""Many LoRA adapters served at once over the unmerged base: for every family, greedy float32 outputs
of requests of four adapters (different ranks and targets) mixed with base-only requests in one batch equal
transformers + PEFT's, under preemption and prefix hits; the prefix cache keeps each adapter's blocks apart;
adapters beyond ``max_loras`` are paged in least recently used out, and requests wait for theirs."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.model_configs import FAMILIES
from tests.support.peft_reference import assert_matches_peft, make_adapter
from tests.support.reference import assert_matches_reference, hf_greedy
from warmstart.runtime import SamplingParams
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.lora import LoraManager, LoraWeights, lora_from_peft
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.llm import LLM
from warmstart.runtime.models.config import ModelConfig

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORAS: dict[str, dict[str, Any]] = {
    "qv4": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all8": {"r": 8, "lora_alpha": 8, "target_modules": ALL, "rank_pattern": {"down_proj": 2}},
    "mlp2-rs": {"r": 2, "lora_alpha": 4, "use_rslora": True, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "ko16": {"r": 16, "lora_alpha": 32, "target_modules": ["k_proj", "o_proj"], "layers_to_transform": [0]},
}
# Phi-3's checkpoint fuses q/k/v and gate/up, so its adapters target the fused modules
PHI3_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                "up_proj": "gate_up_proj"}
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loras_of(tmp_path_factory, tiny_model_dir):  # type: ignore[no-untyped-def]
    """`loras_of(family)` -> {name: PEFT adapter dir} for every entry of LORAS."""
    made: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in made:
            root = tmp_path_factory.mktemp(f"loras-{family}")
            made[family] = {name: make_adapter(tiny_model_dir(family), root / name, "LoraConfig", seed=i,
                                               **for_family(family, options))
                            for i, (name, options) in enumerate(LORAS.items())}
        return made[family]

    return get


def for_family(family: str, options: dict[str, Any]) -> dict[str, Any]:
    if family in ("qwen3_moe", "mixtral"):  # LoRA on the attention alone: no adapter reaches the experts
        attention = [m for m in options["target_modules"] if m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        return {**options, "target_modules": attention or ["q_proj", "o_proj"], "rank_pattern": {}}
    if family != "phi3":
        return options
    return {**options, "target_modules": sorted({PHI3_MODULES.get(m, m) for m in options["target_modules"]}),
            "rank_pattern": {PHI3_MODULES.get(m, m): r for m, r in options.get("rank_pattern", {}).items()}}


def peft_loader(name: str, adapter_dir: Path, config: ModelConfig, calls: list[str] | None = None) -> Any:
    peft_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))

    def load() -> LoraWeights:
        if calls is not None:
            calls.append(name)
        return lora_from_peft(name, peft_config, tensors, config, torch.float32)

    return load


def serve(model_dir: Path, loras: dict[str, Path], **options: Any) -> tuple[LLM, list[str]]:
    """An engine over the float32 model with every adapter of ``loras`` added; returns it and the loads' log."""
    options = EngineOptions(dtype="float32", prepack_weights=False, **options)
    engine = LLMEngine.from_hf(model_dir, options, device="cpu")
    calls: list[str] = []
    for name, path in loras.items():
        rank = max([LORAS[name]["r"], *LORAS[name].get("rank_pattern", {}).values()])
        engine.add_lora(name, peft_loader(name, path, engine.config, calls), rank)
    return LLM(engine), calls


def random_prompts(family: str, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = FAMILIES[family]["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


def check(model_dir: Path, loras: dict[str, Path], prompt: list[int], adapter: str | None, ours: list[int]) -> None:
    if adapter is None:
        assert_matches_reference(model_dir, prompt, ours, MAX_TOKENS)
    else:
        assert_matches_peft(model_dir, loras[adapter], prompt, ours)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mixed_batch_matches_peft_under_preemption_and_prefix_hits(tiny_model_dir, loras_of, family: str) -> None:
    model_dir, loras = tiny_model_dir(family), loras_of(family)
    llm, _ = serve(model_dir, loras, num_kv_blocks=20, max_num_batched_tokens=64)
    shared = (random_prompts(family, 1, seed=1)[0] * 40)[:40]  # its first 2 blocks get cached under "all8"
    warm = llm.generate([shared], GREEDY, adapter="all8")[0]
    prompts = [shared, shared, shared, *random_prompts(family, 9, seed=2)]
    adapters: list[str | None] = ["all8", "qv4", None, *[[*LORAS, None, None][i % 6] for i in range(9)]]
    outs = llm.generate(prompts, GREEDY, adapter=adapters)
    assert llm.engine.scheduler.num_preemptions > 0
    # the same prompt hits only its own adapter's blocks
    assert [o.cached_tokens for o in outs[:3]] == [32, 0, 0]
    assert outs[0].token_ids == warm.token_ids
    for out, prompt, adapter in zip(outs, prompts, adapters, strict=True):
        assert out.adapter == adapter
        check(model_dir, loras, prompt, adapter, out.token_ids)
    for name in LORAS:  # each adapter changes some output of the base model
        mine = [(o, p) for o, p, a in zip(outs, prompts, adapters, strict=True) if a == name]
        assert any(o.token_ids != hf_greedy(model_dir, p, MAX_TOKENS) for o, p in mine), name
    assert llm.engine.blocks.num_used_blocks == 0


def test_prefix_cache_keys_include_the_adapter(tiny_model_dir, loras_of) -> None:
    model_dir, loras = tiny_model_dir("llama"), loras_of("llama")
    llm, _ = serve(model_dir, loras)
    prompt = (random_prompts("llama", 1, seed=3)[0] * 48)[:48]

    def cached(adapter: str | None) -> int:
        return llm.generate([prompt], GREEDY, adapter=adapter)[0].cached_tokens

    assert cached("qv4") == 0
    assert cached("qv4") == 32
    assert cached("ko16") == 0 and cached(None) == 0
    assert cached("ko16") == 32 and cached(None) == 32
    # an adapter added again under the same name (new weights, maybe) never hits the old one's blocks
    llm.engine.remove_lora("qv4")
    llm.engine.add_lora("qv4", peft_loader("qv4", loras["qv4"], llm.engine.config), 4)
    assert cached("qv4") == 0


def test_adapters_beyond_the_slots_are_paged_in(tiny_model_dir, loras_of) -> None:
    model_dir, loras = tiny_model_dir("qwen3"), loras_of("qwen3")
    llm, calls = serve(model_dir, loras, max_loras=2, max_num_seqs=4)
    prompts = random_prompts("qwen3", 10, seed=4)
    adapters: list[str | None] = [[*LORAS, None][i % 5] for i in range(10)]
    outs = llm.generate(prompts, GREEDY, adapter=adapters)
    for out, prompt, adapter in zip(outs, prompts, adapters, strict=True):
        check(model_dir, loras, prompt, adapter, out.token_ids)
    stats = llm.engine.loras.stats
    assert stats.misses == stats.loads == len(calls) > len(LORAS)  # two slots for four adapters: some came back
    assert stats.hits + stats.misses >= 8 and stats.load_seconds > 0
    assert len(llm.engine.loras.resident) == 2


def test_requests_wait_for_their_adapter(tiny_model_dir, loras_of) -> None:
    model_dir, loras = tiny_model_dir("llama"), loras_of("llama")
    llm, calls = serve(model_dir, loras, max_loras=1)
    engine = llm.engine
    prompts = random_prompts("llama", 4, seed=5)
    adapters: list[str | None] = ["qv4", "all8", None, "qv4"]
    for prompt, adapter in zip(prompts, adapters, strict=True):
        engine.add_request(prompt, GREEDY, adapter=adapter)
    engine.step()
    assert sorted(s.adapter or "-" for s in engine.scheduler.running) == ["-", "qv4", "qv4"]
    assert [s.adapter for s in engine.scheduler.waiting] == ["all8"]  # the one slot is in use: it waits
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    assert calls == ["qv4", "all8"]
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        check(model_dir, loras, prompt, adapter, outs[f"req-{i}"])


def test_least_recently_used_idle_adapter_goes_out(tiny_model_dir) -> None:
    config = ModelConfig.from_dir(tiny_model_dir("llama"))
    manager = LoraManager(config, 2, 4, torch.float32, torch.device("cpu"))
    for name in "abcd":
        manager.add(name, lambda name=name: LoraWeights(name, 1, [{} for _ in range(config.num_layers)]), 1)
    assert manager.acquire("a", set()) and manager.acquire("b", set())
    assert manager.acquire("a", set())  # a hit: "a" is now the most recent
    assert manager.acquire("c", set()) and sorted(manager.resident) == ["a", "c"]  # "b" went out
    assert not manager.acquire("d", {"a", "c"})  # both in use: nothing changes
    assert sorted(manager.resident) == ["a", "c"]
    assert manager.acquire("d", {"c"}) and sorted(manager.resident) == ["c", "d"]
    assert (manager.stats.hits, manager.stats.misses) == (1, 4)


def test_bad_lora_calls_are_refused_clearly(tiny_model_dir, loras_of) -> None:
    model_dir, loras = tiny_model_dir("llama"), loras_of("llama")
    llm, _ = serve(model_dir, {"qv4": loras["qv4"]}, max_lora_rank=8)
    engine = llm.engine
    with pytest.raises(ValueError, match="unknown adapter 'nope'.*qv4"):
        engine.add_request([5, 6, 7], GREEDY, adapter="nope")
    with pytest.raises(ValueError, match="rank 16.*ranks 1 to 8.*max-lora-rank"):
        engine.add_lora("ko16", peft_loader("ko16", loras["ko16"], engine.config), 16)
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("qv4", peft_loader("qv4", loras["qv4"], engine.config), 4)
    engine.add_request([5, 6, 7], GREEDY, adapter="qv4")
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.remove_lora("qv4")
    with pytest.raises(ValueError, match="no LoRA adapter 'other'"):
        engine.remove_lora("other")
    while engine.has_unfinished():
        engine.step()
    engine.remove_lora("qv4")
    assert engine.loras.names() == []
    with pytest.raises(ValueError, match="max_loras must be >= 1"):
        EngineOptions(max_loras=0).validate()


def test_an_adapter_that_fails_to_load_aborts_its_requests_not_the_engine(tiny_model_dir, loras_of) -> None:
    model_dir, loras = tiny_model_dir("llama"), loras_of("llama")
    llm, _ = serve(model_dir, {"qv4": loras["qv4"]})

    def broken() -> LoraWeights:
        raise OSError("blob sha256 mismatch")

    llm.engine.add_lora("broken", broken, 4)
    prompts = random_prompts("llama", 3, seed=6)
    adapters: list[str | None] = ["broken", None, "qv4"]
    outs = llm.generate(prompts, GREEDY, adapter=adapters)
    assert outs[0].finish_reason == "abort" and outs[0].token_ids == []
    for out, prompt, adapter in zip(outs[1:], prompts[1:], adapters[1:], strict=True):
        assert out.finish_reason == "length"
        check(model_dir, loras, prompt, adapter, out.token_ids)
    stats = llm.engine.loras.stats
    assert stats.load_errors == 1 and "blob sha256 mismatch" in (stats.last_load_error or "")
    assert llm.engine.blocks.num_used_blocks == 0


def test_speculative_verification_keeps_each_rows_adapter(tiny_model_dir, loras_of) -> None:
    """Prompt lookup proposes once a greedy output repeats itself (random tiny models fall into loops); the
    verified rows carry their sequence's adapter."""
    model_dir, loras = tiny_model_dir("qwen2"), loras_of("qwen2")
    llm, _ = serve(model_dir, loras, speculative="ngram", num_speculative_tokens=3)
    prompts = random_prompts("qwen2", 8, seed=7)
    adapters: list[str | None] = [[*LORAS, None][i % 5] for i in range(8)]
    long = SamplingParams(max_tokens=3 * MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, long, adapter=adapters)
    assert llm.engine.speculation.stats.num_accepted_tokens > 0
    for out, prompt, adapter in zip(outs, prompts, adapters, strict=True):
        if adapter is None:
            assert_matches_reference(model_dir, prompt, out.token_ids, 3 * MAX_TOKENS)
        else:
            assert_matches_peft(model_dir, loras[adapter], prompt, out.token_ids)


def test_llm_takes_every_engine_option_by_name(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM.from_hf(tiny_model_dir("llama"), dtype="float32", num_kv_blocks=32, max_loras=2, max_lora_rank=8)
    assert (llm.engine.options.max_loras, llm.engine.options.max_lora_rank) == (2, 8)
    with pytest.raises(ValueError, match=r"unknown engine option 'max_lora'; the options are .*max_loras"):
        LLM.from_hf(tiny_model_dir("llama"), max_lora=2)


def test_lora_on_experts_is_refused_and_on_a_dense_layer_of_an_moe_model_served() -> None:
    config = ModelConfig.from_dict(FAMILIES["qwen3_moe"])  # layer 1 is dense (mlp_only_layers)
    peft = {"peft_type": "LORA", "r": 2, "lora_alpha": 2}

    def adapter(layer: int) -> dict[str, torch.Tensor]:
        p = f"base_model.model.model.layers.{layer}.mlp.gate_proj"
        return {f"{p}.lora_A.weight": torch.ones(2, 64), f"{p}.lora_B.weight": torch.ones(96, 2)}

    with pytest.raises(ValueError, match="LoRA on layer 0's experts is not supported; target the attention"):
        lora_from_peft("x", peft, adapter(0), config, torch.float32)
    assert lora_from_peft("x", peft, adapter(1), config, torch.float32).targets == ["gate_proj"]
