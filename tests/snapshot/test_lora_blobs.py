"""LoRA adapters as their own blobs: a snapshot with one more adapter uploads only that adapter's blob
(to a local store and to a moto server), an adapter pushed on its own against a snapshot lands atomically and is
verified when fetched, gc keeps what pushed adapters need, and what is not a plain LoRA is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from tests.support.aws import isolate_aws
from tests.support.lora_adapters import specs
from warmstart.snapshot.adapters import AdapterSpec
from warmstart.snapshot.build import BuildOptions, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.errors import BuildError, CorruptBlob
from warmstart.snapshot.gc import gc
from warmstart.snapshot.lora import LoraError, LoraNotFound, fetch_lora, lora_loader, push_lora
from warmstart.snapshot.store import LocalStore, Store
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import push_snapshot


def a_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Store:
    if kind == "local":
        return LocalStore(tmp_path / "store")
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("moto_endpoint"))
    bucket = f"loras-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return open_store(f"s3://{bucket}/models")


def stored_blobs(store: Store) -> set[str]:
    return {blob for blob, _, _ in store.list_blobs()}


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_second_snapshot_with_one_more_adapter_uploads_only_that_adapter(
        kind: str, model_dir: Path, loras: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = a_store(kind, tmp_path, request, monkeypatch)
    cache = BlobCache(tmp_path / "cache")
    first = build_snapshot(model_dir, BuildOptions(dtype="float32", loras=specs(loras, "sql")), cache)
    push_snapshot(store, first.manifest.encode(), first.id, first.blob_paths)
    before = stored_blobs(store)
    second = build_snapshot(model_dir, BuildOptions(dtype="float32", loras=specs(loras, "sql", "chat")), cache)
    stats = push_snapshot(store, second.manifest.encode(), second.id, second.blob_paths)
    added = second.manifest.data["loras"][1]
    assert added["name"] == "chat" and second.id != first.id
    assert stored_blobs(store) - before == {added["blob"]}  # what the store holds now: one blob more
    assert (stats.blobs_uploaded, stats.bytes_uploaded) == (1, second.manifest.data["blobs"][added["blob"]])
    assert second.manifest.data["tensors"] == first.manifest.data["tensors"]  # the base blobs are shared
    assert second.manifest.data["loras"][0] == first.manifest.data["loras"][0]


def test_a_damaged_adapter_blob_is_refused_when_the_engine_pages_it_in(model_dir: Path, loras: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "cache")
    built = build_snapshot(model_dir, BuildOptions(dtype="float32", loras=specs(loras, "math")), cache)
    entry = built.manifest.data["loras"][0]
    size = built.manifest.data["blobs"][entry["blob"]]
    assert lora_loader(entry, cache, size)().rank == 2
    path = cache.path(entry["blob"])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only a hash sees it
    path.write_bytes(bytes(data))
    with pytest.raises(LoraError, match="does not hash to its id"):
        lora_loader(entry, cache, size)()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_lora_push_uploads_the_adapter_alone_and_fetch_verifies_it(
        kind: str, model_dir: Path, loras: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = a_store(kind, tmp_path, request, monkeypatch)
    cache = BlobCache(tmp_path / "cache")
    base = build_snapshot(model_dir, BuildOptions(dtype="float32"), cache)
    push_snapshot(store, base.manifest.encode(), base.id, base.blob_paths)
    store.set_ref("base", base.id)
    before = stored_blobs(store)
    sid, document, stats = push_lora(store, cache, AdapterSpec("math", loras["math"]), "base")
    assert sid == base.id and store.get_lora(sid, "math") == document
    new = stored_blobs(store) - before
    assert document in new and len(new) == stats.blobs_uploaded == 2  # the adapter's blob and its document
    assert push_lora(store, cache, AdapterSpec("math", loras["math"]), sid)[2].blobs_uploaded == 0

    serve_cache = BlobCache(tmp_path / "serve-cache")
    entry, size = fetch_lora(store, serve_cache, sid, "math")
    assert serve_cache.has(entry["blob"], size) and lora_loader(entry, serve_cache, size)().rank == 2
    with pytest.raises(LoraNotFound, match=r"no LoRA adapter 'nope' of snapshot \w+ in .*\(pushed against it: math;"):
        fetch_lora(store, serve_cache, sid, "nope")
    report = gc(store, grace_seconds=0)
    assert report.blobs_deleted == 0 and new <= stored_blobs(store)  # gc keeps what a pushed adapter needs


def test_a_pushed_adapter_whose_document_is_damaged_is_refused(model_dir: Path, loras: dict[str, Path],
                                                              tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    cache = BlobCache(tmp_path / "cache")
    base = build_snapshot(model_dir, BuildOptions(dtype="float32"), cache)
    push_snapshot(store, base.manifest.encode(), base.id, base.blob_paths)
    _, document, _ = push_lora(store, cache, AdapterSpec("sql", loras["sql"]), base.id)
    stored = store.root / "blobs" / document
    data = bytearray(stored.read_bytes())
    data[5] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(CorruptBlob, match="does not match its name"):
        fetch_lora(store, BlobCache(tmp_path / "serve-cache"), base.id, "sql")


def _peft_config_edit(src: Path, dst: Path, **changes: Any) -> Path:
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


@pytest.mark.parametrize(("case", "words"), [
    ("modules_to_save", "--lora sql: LoRA adapter 'sql': adapters with modules_to_save"),
    ("prompt-tuning", "--lora sql: "),
    ("twice", "--lora: name(s) given twice: sql"),
    ("also-an-adapter", "sql: named by both --lora and --adapter"),
    ("tensor-parallel", "--lora NAME=DIR does not combine with --tensor-parallel"),
])
def test_what_is_not_a_plain_lora_is_refused_naming_flag_and_adapter(
        case: str, words: str, model_dir: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    sql = AdapterSpec("sql", loras["sql"])
    options = {
        "modules_to_save": BuildOptions(loras=[AdapterSpec("sql", _peft_config_edit(
            loras["sql"], tmp_path / "mts", modules_to_save=["lm_head"]))]),
        "prompt-tuning": BuildOptions(loras=[AdapterSpec("sql", _peft_config_edit(
            loras["sql"], tmp_path / "pt", peft_type="PROMPT_TUNING"))]),
        "twice": BuildOptions(loras=[sql, sql]),
        "also-an-adapter": BuildOptions(loras=[sql], adapters=[sql]),
        "tensor-parallel": BuildOptions(loras=[sql], tensor_parallel=2),
    }[case]
    with pytest.raises(BuildError) as e:
        build_snapshot(model_dir, options, BlobCache(tmp_path / "cache"))
    assert words in str(e.value)
    if case == "prompt-tuning":
        assert "takes LoRA adapters" in str(e.value)


def test_lora_blob_views_have_the_stored_dtype(model_dir: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "cache")
    built = build_snapshot(model_dir, BuildOptions(dtype="bfloat16", loras=specs(loras, "sql")), cache)
    entry = built.manifest.data["loras"][0]
    lora = lora_loader(entry, cache, built.manifest.data["blobs"][entry["blob"]])()
    assert {t.dtype for t in lora.tensors().values()} == {torch.bfloat16}
