"""PEFT adapters compiled at build time, in the engine: greedy outputs equal peft's (tests/support/peft_reference.py)
for every adapter type and family, mixed batches equal solo runs, prefix hits and preemption keep the adapter,
LoRA merged as peft merges it, padding waste reported, bad adapters refused clearly. Serving them over HTTP
and the "auto" selector: tests/e2e/test_adapters_serve.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import peft
import pytest
import torch

from tests.support.model_configs import FAMILIES
from tests.support.peft_reference import _hf, assert_matches_peft, make_adapter
from warmstart.runtime import SamplingParams
from warmstart.runtime.engine.adapters import alignment_advice, virtual_token_ids, wasted_slots
from warmstart.snapshot.adapters import AdapterSpec
from warmstart.snapshot.build import BuildError, BuildOptions, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.loader import load_with_report
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import push_snapshot

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# name -> (peft config kind, options); virtual-token counts chosen to end inside a block of 16 (and one not)
ADAPTERS: dict[str, tuple[str, dict[str, Any]]] = {
    "prompt": ("PromptTuningConfig", {"num_virtual_tokens": 5}),
    "ptune-mlp": ("PromptEncoderConfig", {"num_virtual_tokens": 19, "encoder_hidden_size": 32}),
    "ptune-lstm": ("PromptEncoderConfig", {"num_virtual_tokens": 7, "encoder_hidden_size": 16,
                                           "encoder_reparameterization_type": "LSTM"}),
    "prefix": ("PrefixTuningConfig", {"num_virtual_tokens": 16}),
    "prefix-proj": ("PrefixTuningConfig", {"num_virtual_tokens": 21, "prefix_projection": True,
                                           "encoder_hidden_size": 32}),
}


@pytest.fixture(scope="module")
def adapters_of(tmp_path_factory, tiny_model_dir):  # type: ignore[no-untyped-def]
    """`adapters_of(family)` -> {name: adapter dir} for every entry of ADAPTERS, saved by peft."""
    made: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in made:
            root = tmp_path_factory.mktemp(f"adapters-{family}")
            model_dir = tiny_model_dir(family)
            made[family] = {name: make_adapter(model_dir, root / name, kind, seed=i, **opts)
                            for i, (name, (kind, opts)) in enumerate(ADAPTERS.items())}
        return made[family]

    return get


def build_and_load(model_dir: Path, tmp_path: Path, **options: Any):  # type: ignore[no-untyped-def]
    cache = BlobCache(tmp_path / "build-cache")
    store = open_store(str(tmp_path / "store"))
    logs: list[str] = []
    built = build_snapshot(model_dir, BuildOptions(dtype="float32", **options), cache, logs.append)
    push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    llm, report = load_with_report(built.id, store=store, cache=tmp_path / "serve-cache", num_kv_blocks=96,
                                   prepack_weights=False)
    return built, llm, logs


def prompts(family: str, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = FAMILIES[family]["vocab_size"]
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(count)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "olmo2", "phi3", "gemma2", "gemma3"])
def test_every_adapter_type_matches_peft(tiny_model_dir, adapters_of, tmp_path: Path, family: str) -> None:
    model_dir = tiny_model_dir(family)
    adapters = adapters_of(family)
    specs = [AdapterSpec(name, path) for name, path in adapters.items()]
    built, llm, logs = build_and_load(model_dir, tmp_path, adapters=specs)
    entries = {a["name"]: a for a in built.manifest.data["adapters"]}
    assert sorted(entries) == sorted(ADAPTERS)
    batch = prompts(family, 2)
    names = [name for name in ADAPTERS for _ in batch]
    outs = llm.generate(batch * len(ADAPTERS), GREEDY, adapter=names)  # one batch, every adapter at once
    base = llm.generate(batch, GREEDY)
    for out, name, prompt in zip(outs, names, batch * len(ADAPTERS), strict=True):
        assert out.adapter == name and out.prompt_token_ids == prompt
        assert entries[name]["num_virtual_tokens"] == ADAPTERS[name][1]["num_virtual_tokens"]
        assert_matches_peft(model_dir, adapters[name], prompt, out.token_ids)
    # the adapters matter: each changes some output of the base model
    for i, name in enumerate(ADAPTERS):
        assert [o.token_ids for o in outs[i * len(batch) : (i + 1) * len(batch)]] != [o.token_ids for o in base], name


def test_mixed_batch_equals_each_request_alone_and_frees_every_block(tiny_model_dir, adapters_of,
                                                                       tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    specs = [AdapterSpec(name, path) for name, path in adapters_of("llama").items()]
    _, llm, _ = build_and_load(model_dir, tmp_path, adapters=specs)
    engine = llm.engine
    free_before = engine.blocks.num_free_blocks
    rng = random.Random(3)
    batch = prompts("llama", 12, seed=3)
    choice: list[str | None] = [rng.choice([*ADAPTERS, None]) for _ in batch]
    sampled = SamplingParams(max_tokens=5, temperature=0.8, seed=11, ignore_eos=True)
    together = llm.generate(batch, sampled, adapter=choice)
    alone = [llm.generate([p], sampled, adapter=a)[0] for p, a in zip(batch, choice, strict=True)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.adapter for o in together] == choice
    assert engine.blocks.num_free_blocks == free_before


def test_second_request_hits_the_blocks_behind_the_adapter(tiny_model_dir, adapters_of, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    path = adapters_of("llama")["prompt"]  # 5 virtual tokens: 11 prompt tokens fill its block
    _, llm, _ = build_and_load(model_dir, tmp_path, adapters=[AdapterSpec("prompt", path)])
    prompt = prompts("llama", 1, seed=5)[0] * 3
    first = llm.generate([prompt], GREEDY, adapter="prompt")[0]
    again = llm.generate([prompt], GREEDY, adapter="prompt")[0]
    plain = llm.generate([prompt], GREEDY)[0]
    assert first.cached_tokens == 0 and plain.cached_tokens == 0  # the adapter's blocks are not the base's
    assert again.cached_tokens == (5 + len(prompt) - 1) // 16 * 16 - 5
    assert again.token_ids == first.token_ids
    assert_matches_peft(model_dir, path, prompt, again.token_ids)


def test_preempted_requests_keep_their_adapter(tiny_model_dir, adapters_of, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen3")
    adapters = adapters_of("qwen3")
    built, _, _ = build_and_load(model_dir, tmp_path / "a", adapters=[AdapterSpec(n, p) for n, p in adapters.items()])
    llm, _ = load_with_report(built.id, store=open_store(str(tmp_path / "a" / "store")), cache=tmp_path / "c2",
                              num_kv_blocks=24, max_num_batched_tokens=64, prepack_weights=False)
    batch = prompts("qwen3", 6, seed=9)
    names = ["prefix-proj", "ptune-mlp", "prompt"] * 2
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outs = llm.generate(batch, long, adapter=names)
    assert llm.engine.scheduler.num_preemptions > 0
    for out, name, prompt in zip(outs, names, batch, strict=True):
        assert_matches_peft(model_dir, adapters[name], prompt, out.token_ids)


def test_lora_merge_matches_peft_and_shares_untouched_blobs(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen2")
    lora = make_adapter(model_dir, tmp_path / "lora", "LoraConfig", seed=4, r=4, lora_alpha=16,
                        target_modules=["q_proj", "v_proj", "down_proj"])
    base, _, _ = build_and_load(model_dir, tmp_path / "base")
    merged, llm, logs = build_and_load(model_dir, tmp_path / "merged", lora=lora)
    assert any("merged LoRA" in line and "6 weight" in line for line in logs)
    base_blobs = {t["blob"] for name, t in base.manifest.data["tensors"].items() if name.startswith("layers.")}
    merged_blobs = {t["blob"] for name, t in merged.manifest.data["tensors"].items() if name.startswith("layers.")}
    assert not base_blobs & merged_blobs  # every layer holds a merged weight
    head = {t["blob"] for name, t in base.manifest.data["tensors"].items() if not name.startswith("layers.")}
    assert head <= set(merged.manifest.blob_ids())  # embeddings and head are shared
    batch = prompts("qwen2", 3)
    outs = llm.generate(batch, GREEDY)
    merged_ref = peft.PeftModel.from_pretrained(_hf(model_dir), lora).merge_and_unload().eval()
    with torch.no_grad():
        for out, prompt in zip(outs, batch, strict=True):
            seq = list(prompt)
            for token in out.token_ids:
                logits = merged_ref(input_ids=torch.tensor([seq])).logits[0, -1]
                ref = int(logits.argmax())
                if token != ref:
                    top = logits.topk(2).values
                    assert float(top[0] - top[1]) < 1e-3
                    break
                seq.append(token)


def test_build_reports_padding_waste_and_a_size_that_wastes_none(tiny_model_dir, adapters_of, tmp_path) -> None:
    adapters = adapters_of("llama")
    built, _, logs = build_and_load(tiny_model_dir("llama"), tmp_path,
                                    adapters=[AdapterSpec(n, adapters[n]) for n in ("prefix", "prefix-proj")])
    entries = {a["name"]: a for a in built.manifest.data["adapters"]}
    assert entries["prefix"]["wasted_slots"] == 0 and entries["prefix-proj"]["wasted_slots"] == 11
    line = next(line for line in logs if "'prefix-proj'" in line)
    assert "11 of 32 KV slots unused" in line and "16 or 32 virtual tokens" in line
    assert wasted_slots(48, 32) == 16 and "block size 8 or 16" in alignment_advice(48, 32)


def test_virtual_token_ids_are_negative_and_distinct_per_adapter() -> None:
    a, b = virtual_token_ids("a", 300), virtual_token_ids("b", 300)
    assert all(t < 0 for t in a + b) and not set(a) & set(b) and len(set(a)) == 300


# -- refused with a clear error ------------------------------------------------------------------------------


def _broken_adapter(tmp_path: Path, source: Path, edit: dict[str, Any] | None = None, drop_weights: bool = False
                    ) -> Path:
    out = tmp_path / "broken"
    out.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **(edit or {})}))
    if not drop_weights:
        (out / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    return out


@pytest.mark.parametrize(("case", "message"), [
    ("other-base", r"prompt_embeddings has shape \(5, 96\); this model needs \(5, 128\).*another base model"),
    ("unsupported", "adapter type 'IA3' is not supported"),
    ("lora-as-adapter", "is a LoRA adapter; merge it into the weights with --lora"),
    ("no-weights", "has no adapter_model.safetensors"),
    ("not-a-dir", "is not a PEFT adapter directory"),
    ("count", r"prompt_embeddings has shape \(5, 128\); this model needs \(6, 128\)"),
])
def test_bad_adapters_are_refused(tiny_model_dir, adapters_of, tmp_path: Path, case: str, message: str) -> None:
    model_dir = tiny_model_dir("llama3")  # hidden 128
    source = adapters_of("llama")["prompt"]  # hidden 96, 5 virtual tokens
    path = {
        "other-base": lambda: source,
        "unsupported": lambda: _broken_adapter(tmp_path, source, {"peft_type": "IA3"}),
        "lora-as-adapter": lambda: _broken_adapter(tmp_path, source, {"peft_type": "LORA"}),
        "no-weights": lambda: _broken_adapter(tmp_path, source, drop_weights=True),
        "not-a-dir": lambda: tmp_path / "nothing-here",
        "count": lambda: adapters_of("llama3")["prompt"],
    }[case]()
    if case == "count":
        path = _broken_adapter(tmp_path, path, {"num_virtual_tokens": 6})
    with pytest.raises(BuildError, match=message):
        build_snapshot(model_dir, BuildOptions(adapters=[AdapterSpec("x", path)]), BlobCache(tmp_path / "c"))


def test_bad_adapter_names_and_flags_are_refused(tmp_path: Path) -> None:
    for text in ("auto=dir", "no-equals", "=dir", "bad name=dir"):
        with pytest.raises(BuildError, match="expected NAME=PATH"):
            AdapterSpec.parse(text)
    options = BuildOptions(adapters=[AdapterSpec("a", tmp_path)], adapter_examples=[AdapterSpec("b", tmp_path)])
    with pytest.raises(BuildError, match="--adapter-examples for b, which no --adapter names"):
        options.validate()


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_speculative_decoding_keeps_adapter_outputs(tiny_model_dir, adapters_of, tmp_path: Path,
                                                    speculative: str) -> None:
    model_dir = tiny_model_dir("llama")
    specs = [AdapterSpec(name, path) for name, path in adapters_of("llama").items()]
    built, plain, _ = build_and_load(model_dir, tmp_path, adapters=specs, draft=model_dir)
    spec, _ = load_with_report(built.id, store=open_store(str(tmp_path / "store")), cache=tmp_path / "serve-cache",
                               num_kv_blocks=96, prepack_weights=False, speculative=speculative)
    batch = [p * 3 for p in prompts("llama", 6, seed=2)]  # repeats give prompt lookup something to propose
    names: list[str | None] = [*ADAPTERS, None]
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = spec.generate(batch, long, adapter=names)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(batch, long, adapter=names)]
    stats = spec.engine.stats()
    assert stats.spec_num_drafts > 0  # speculation ran (for the base request at least)
    assert spec.engine.blocks.num_free_blocks == plain.engine.blocks.num_free_blocks
