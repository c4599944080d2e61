"""Build a snapshot into a local store, load it back: same outputs, prefixes served as cache hits."""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import pytest

from tests.support.model_configs import FAMILIES
from tests.support.reference import assert_matches_reference
from warmstart.runtime import LLM, SamplingParams
from warmstart.snapshot import loader as load_mod
from warmstart.snapshot.build import BuildError, BuildOptions, PrefixSpec, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.format import Manifest
from warmstart.snapshot.loader import SnapshotError, load_with_report
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import push_snapshot

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM_TEXT = "You are a terse assistant. Answer in one short sentence, and never apologise for anything. " * 3
PREFIX_TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 3


def build_and_push(model_dir: Path, tmp_path: Path, prefixes: list[PrefixSpec] | None = None, **opts):  # type: ignore[no-untyped-def]
    cache = BlobCache(tmp_path / "build-cache")
    store = open_store(str(tmp_path / "store"))
    built = build_snapshot(model_dir, BuildOptions(dtype="float32", prefixes=prefixes or [], **opts), cache)
    stats = push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    return built, stats, store


def prefix_files(tmp_path: Path) -> list[PrefixSpec]:
    (tmp_path / "system.txt").write_text(SYSTEM_TEXT)
    (tmp_path / "prefix.txt").write_text(PREFIX_TEXT)
    return [
        PrefixSpec("doc", tmp_path / "prefix.txt", "text"),
        PrefixSpec("assistant", tmp_path / "system.txt", "system"),
    ]


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2"])
def test_snapshot_outputs_equal_the_hf_directory(tiny_model_dir, tmp_path: Path, family: str) -> None:
    model_dir = tiny_model_dir(family)
    built, _, store = build_and_push(model_dir, tmp_path)
    rng = random.Random(1)
    vocab = FAMILIES[family]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 60))] for _ in range(6)]
    # a fresh cache: everything comes from the store
    llm, report = load_with_report(built.id, store=store, cache=tmp_path / "serve-cache", num_kv_blocks=128)
    assert report.blobs_downloaded == report.blobs_total > 0
    ours = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    from_hf = LLM.from_hf(model_dir, dtype="float32", num_kv_blocks=128)
    reference = [o.token_ids for o in from_hf.generate(prompts, GREEDY)]
    assert ours == reference


def test_first_request_after_load_hits_the_prefix_blocks(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    built, _, store = build_and_push(model_dir, tmp_path, prefix_files(tmp_path))
    entries = {p["name"]: p for p in built.manifest.data["prefixes"]}
    assert entries["doc"]["block_hashes"] and entries["assistant"]["block_hashes"]
    llm = load_mod.load(built.id, store=store, cache=tmp_path / "serve-cache", num_kv_blocks=128)
    tok = llm.tokenizer
    doc_prompt = tok.encode(PREFIX_TEXT + "And then")
    chat_prompt = tok.encode_chat([{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": "Hi there"}])
    outs = llm.generate([doc_prompt, chat_prompt], GREEDY)
    block = built.manifest.data["engine"]["block_size"]
    assert outs[0].cached_tokens == len(entries["doc"]["block_hashes"]) * block
    assert outs[1].cached_tokens == len(entries["assistant"]["block_hashes"]) * block
    assert outs[1].cached_tokens >= 32
    for prompt, out in zip([doc_prompt, chat_prompt], outs, strict=True):
        assert_matches_reference(model_dir, prompt, out.token_ids, GREEDY.max_tokens)


def test_the_build_says_what_of_each_prefix_will_be_cached(tiny_model_dir, tmp_path: Path) -> None:
    """Only whole KV blocks are shared: a prefix under one block is cached not at all, and the build says so."""
    (tmp_path / "short.txt").write_text("Be brief.")
    specs = [*prefix_files(tmp_path), PrefixSpec("short", tmp_path / "short.txt", "text")]
    lines: list[str] = []
    built = build_snapshot(tiny_model_dir("llama"), BuildOptions(dtype="float32", prefixes=specs),
                           BlobCache(tmp_path / "cache"), lines.append)
    said = {line.split("'")[1]: line for line in lines if line.startswith("computing prefix KV")}
    entries = {p["name"]: p for p in built.manifest.data["prefixes"]}
    assert "nothing of it can be served from the cache" in said["short"] and not entries["short"]["block_hashes"]
    cached = len(entries["doc"]["block_hashes"]) * built.manifest.data["engine"]["block_size"]
    assert f": {cached} served from the prefix cache" in said["doc"]


def test_rebuild_uploads_nothing_and_a_prefix_change_uploads_only_its_kv(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen2")
    prefixes = prefix_files(tmp_path)
    first, stats1, _ = build_and_push(model_dir, tmp_path, prefixes)
    assert stats1.blobs_uploaded == stats1.blobs_total
    again, stats2, _ = build_and_push(model_dir, tmp_path, prefixes)
    assert again.id == first.id
    assert stats2.blobs_uploaded == 0 and stats2.bytes_uploaded == 0
    (tmp_path / "prefix.txt").write_text(PREFIX_TEXT + " A new ending for the document prefix, long enough.")
    changed, stats3, _ = build_and_push(model_dir, tmp_path, prefixes)
    assert changed.id != first.id
    old_doc = next(p for p in first.manifest.data["prefixes"] if p["name"] == "doc")
    new_doc = next(p for p in changed.manifest.data["prefixes"] if p["name"] == "doc")
    assert stats3.blobs_uploaded == 1 and new_doc["blob"] != old_doc["blob"]
    assert stats3.bytes_uploaded == changed.manifest.data["blobs"][new_doc["blob"]]


def test_quantized_snapshot_maps_and_generates(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    built, _, store = build_and_push(model_dir, tmp_path, quant="int8")
    assert built.manifest.data["quantized"]
    llm = load_mod.load(built.id, store=store, cache=tmp_path / "serve-cache", num_kv_blocks=64)
    out = llm.generate([[5, 6, 7, 8, 9]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens


def test_weights_are_views_of_the_mapped_blobs(tiny_model_dir, tmp_path: Path) -> None:
    built, _, store = build_and_push(tiny_model_dir("llama"), tmp_path)
    llm = load_mod.load(built.id, store=store, cache=tmp_path / "c", num_kv_blocks=16)
    weights = llm.engine.runner.model.weights
    cache = BlobCache(tmp_path / "c")
    layer0 = built.manifest.view().tensors["layers.0.qkv"]
    mapped = load_mod.map_blob(cache.path(layer0.blob))
    assert weights.layers[0].qkv.equal(load_mod.tensor_view(mapped, layer0))
    assert weights.layers[0].qkv.untyped_storage().nbytes() == built.manifest.data["blobs"][layer0.blob]


def test_kv_from_another_engine_version_is_refused(tiny_model_dir, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    built, _, store = build_and_push(tiny_model_dir("llama"), tmp_path, prefix_files(tmp_path))
    from warmstart import runtime
    monkeypatch.setattr(runtime, "__version__", "999.0.0")
    with pytest.raises(SnapshotError, match="rebuild"):
        load_mod.load(built.id, store=store, cache=tmp_path / "c", num_kv_blocks=64)


def test_block_size_other_than_the_build_is_refused(tiny_model_dir, tmp_path: Path) -> None:
    built, _, store = build_and_push(tiny_model_dir("llama"), tmp_path)
    with pytest.raises(SnapshotError, match="block_size=16"):
        load_mod.load(built.id, store=store, cache=tmp_path / "c", block_size=32)


def test_same_inputs_give_the_same_manifest_bytes(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("mistral")
    a = build_snapshot(model_dir, BuildOptions(dtype="float32"), BlobCache(tmp_path / "a"))
    b = build_snapshot(model_dir, BuildOptions(dtype="float32"), BlobCache(tmp_path / "b"))
    assert a.manifest.encode() == b.manifest.encode()
    decoded = msgpack.unpackb(a.manifest.encode(), raw=False, strict_map_key=False)
    assert Manifest(decoded).id == a.id


@pytest.mark.parametrize(
    ("spec", "message"),
    [("noequals", "NAME=FILE"), ("bad name=x.txt", "NAME=FILE"), ("ok=/does/not/exist.txt", "cannot read")],
)
def test_bad_prefix_arguments_get_clear_errors(tiny_model_dir, tmp_path: Path, spec: str, message: str) -> None:
    with pytest.raises(BuildError, match=message):
        prefixes = [PrefixSpec.parse(spec, "text")]
        build_snapshot(tiny_model_dir("llama"), BuildOptions(prefixes=prefixes), BlobCache(tmp_path / "c"))


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="not a directory"):
        build_snapshot(tmp_path / "nope", BuildOptions(), BlobCache(tmp_path / "c"))
