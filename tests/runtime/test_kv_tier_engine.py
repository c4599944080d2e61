"""The KV tier inside the engine: a fresh engine (a new instance's empty pool) loads a conversation's stored
segments and generates exactly what computing them would, for every family; a failing, damaged or slow tier
costs a recompute, never a wrong token."""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Callable

import pytest
import torch

from tests.support.model_configs import FAMILIES
from warmstart.runtime import EngineOptions, LLMEngine, SamplingParams
from warmstart.runtime.engine.kv_tier import KVTier, TierScope

KEY = b"a key the instances share, 32 b."

ModelDir = Callable[[str], pathlib.Path]
BLOCK = 4
SEGMENT = 2  # blocks


class MemoryBackend:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.objects.get(key)

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = data


def engine(model_dir: pathlib.Path, backend: MemoryBackend | None, timeout_s: float = 10.0) -> LLMEngine:
    e = LLMEngine.from_hf(model_dir, EngineOptions(dtype="float32", block_size=BLOCK, num_kv_blocks=96))
    if backend is not None:
        c = e.config
        scope = TierScope("default", "snap", "", "float32", BLOCK, (c.num_layers, c.num_kv_heads, c.head_dim))
        e.attach_kv_tier(KVTier(backend, scope, segment_blocks=SEGMENT, key=KEY), lookup_timeout_s=timeout_s)
    return e


def run(e: LLMEngine, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens served from cache (pool or tier)."""
    rid = e.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while True:
        for out in e.step():
            if out.request_id == rid and out.finished:
                return out.token_ids, out.cached_tokens


def turns(vocab: int) -> tuple[list[int], list[int]]:
    first = [(13 * i + 5) % vocab for i in range(45)]  # 11 full blocks: five whole segments and a tail
    return first, [(7 * i + 3) % vocab for i in range(11)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_fresh_engine_continues_a_conversation_from_the_tier_exactly(family: str, tiny_model_dir: ModelDir) -> None:
    model_dir = tiny_model_dir(family)
    first, second = turns(FAMILIES[family]["vocab_size"])
    backend = MemoryBackend()
    writer = engine(model_dir, backend)
    reply, _ = run(writer, first)
    assert writer.admission.tier_link is not None
    writer.admission.tier_link.tier.close()  # the writes are flushed
    assert backend.objects, "nothing was written to the tier"
    turn2 = first + reply + second
    expected, cached_without = run(engine(model_dir, None), turn2)
    fresh = engine(model_dir, backend)
    got, cached = run(fresh, turn2)
    assert got == expected
    assert cached_without == 0 and cached >= 5 * SEGMENT * BLOCK  # the first turn's five segments at least
    stats = fresh.admission.tier_link.tier.stats if fresh.admission.tier_link else None
    assert stats is not None and stats.hit_blocks * BLOCK == cached and stats.faults == 0


def test_compiled_adapters_and_the_base_never_share_tier_segments(tiny_model_dir: ModelDir) -> None:
    model_dir = tiny_model_dir("llama")
    prompt, _ = turns(FAMILIES["llama"]["vocab_size"])
    backend = MemoryBackend()
    writer = engine(model_dir, backend)
    kv = writer.prefixes.virtual_tokens_kv(torch.randn(5, writer.config.hidden_size))
    writer.prefixes.load_adapter("soft", "PROMPT_TUNING", 5, kv)
    rid = writer.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), adapter="soft")
    while writer.has_unfinished():
        writer.step()
    assert rid and writer.admission.tier_link is not None
    writer.admission.tier_link.tier.close()
    assert backend.objects
    _, cached = run(engine(model_dir, backend), prompt)  # the base model, same tokens: nothing to load
    assert cached == 0


@pytest.mark.parametrize("fault", ["errors", "damaged", "slow"])
def test_a_faulty_tier_costs_a_recompute_never_a_wrong_token(fault: str, tiny_model_dir: ModelDir) -> None:
    model_dir = tiny_model_dir("qwen3")
    first, second = turns(FAMILIES["qwen3"]["vocab_size"])
    good = MemoryBackend()
    writer = engine(model_dir, good)
    reply, _ = run(writer, first)
    assert writer.admission.tier_link is not None
    writer.admission.tier_link.tier.close()
    release = threading.Event()

    class Faulty(MemoryBackend):
        def get(self, key: str) -> bytes | None:
            if fault == "errors":
                raise ConnectionError("the tier is down")
            if fault == "slow":
                release.wait(10)
            data = good.objects.get(key)
            return data[:-1] + bytes([data[-1] ^ 0xFF]) if data and fault == "damaged" else data

    turn2 = first + reply + second
    expected, _ = run(engine(model_dir, None), turn2)
    faulty = engine(model_dir, Faulty(), timeout_s=0.2)
    got, cached = run(faulty, turn2)
    release.set()
    assert got == expected and cached == 0
    assert faulty.admission.tier_link is not None and faulty.admission.tier_link.tier.stats.faults >= 1


def test_the_tier_refuses_an_engine_it_cannot_serve(tiny_model_dir: ModelDir) -> None:
    e = LLMEngine.from_hf(tiny_model_dir("llama"), EngineOptions(dtype="float32", enable_prefix_caching=False))
    scope = TierScope("default", "snap", "", "float32", 16, (2, 2, 16))
    with pytest.raises(ValueError, match="needs prefix caching"):
        e.attach_kv_tier(KVTier(MemoryBackend(), scope, key=KEY))


def test_lora_requests_are_left_out_of_the_tier(tiny_model_dir: ModelDir, tmp_path: pathlib.Path) -> None:
    """A LoRA adapter's blocks chain from a root drawn at its registration, which no other process shares: the
    tier neither stores nor looks up its requests, and they generate what they would without a tier."""
    import json

    from safetensors.torch import load_file

    from tests.support.peft_reference import make_adapter
    from warmstart.runtime.engine.lora import lora_from_peft

    model_dir = tiny_model_dir("llama")
    adapter = make_adapter(model_dir, tmp_path / "qv", "LoraConfig", seed=0, r=4, lora_alpha=16,
                           target_modules=["q_proj", "v_proj"])  # fmt: skip
    peft_config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    prompt, _ = turns(FAMILIES["llama"]["vocab_size"])
    outputs = []
    backend = MemoryBackend()
    for tier in (None, backend):
        e = engine(model_dir, tier)
        config = e.config
        e.add_lora("qv", lambda: lora_from_peft("qv", peft_config, tensors, config, torch.float32), 4)  # noqa: B023
        rid = e.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), adapter="qv")
        done = None
        while done is None:
            done = next((o.token_ids for o in e.step() if o.request_id == rid and o.finished), None)
        outputs.append(done)
        if e.admission.tier_link is not None:
            e.admission.tier_link.tier.close()
    assert outputs[0] == outputs[1] and backend.objects == {}
