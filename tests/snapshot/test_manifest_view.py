"""snapshot.manifest_view: a built snapshot's manifest read as typed records, each the map's own values, and a
sharded one read per rank."""

from __future__ import annotations

from pathlib import Path

from tests.support.model_configs import FAMILIES
from warmstart.runtime.random_model import make_random_model
from warmstart.snapshot.build import build_snapshot
from warmstart.snapshot.build_parts import BuildOptions, PrefixSpec
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.manifest_view import ManifestView, TensorEntry


def test_every_record_holds_what_its_map_holds(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "sys.txt").write_text("You are a careful assistant who answers in full sentences, always.")
    prefix = PrefixSpec("support", tmp_path / "sys.txt", "text")
    options = BuildOptions(dtype="float32", block_size=4, prefixes=[prefix])
    built = build_snapshot(tiny_model_dir("llama"), options, BlobCache(tmp_path / "cache"))
    data, view = built.manifest.data, built.manifest.view()
    assert view.architecture == "LlamaForCausalLM" and view.model_config == data["model"]["config"]
    assert (view.engine.dtype, view.engine.block_size) == ("float32", 4) and view.engine.version
    assert view.tensors["embed"] == TensorEntry.read(data["tensors"]["embed"])
    assert view.tensors["embed"].shape == tuple(data["tensors"]["embed"]["shape"])
    (prefix,) = view.prefixes
    raw = data["prefixes"][0]
    assert (prefix.name, prefix.token_ids, prefix.block_hashes) == (raw["name"], raw["token_ids"], raw["block_hashes"])
    assert prefix.kv is not None and prefix.kv.blob == raw["blob"] and prefix.kv.shape == tuple(raw["shape"])
    assert prefix.cached_tokens(4) == len(raw["block_hashes"]) * 4 > 0
    assert view.weight_blobs() == {t["blob"]: data["blobs"][t["blob"]] for t in data["tensors"].values()}
    assert view.adapters == [] and view.loras == [] and view.adapter_selector is None and view.draft is None


def test_a_sharded_manifest_is_read_per_rank(tmp_path: Path) -> None:
    model_dir = make_random_model(tmp_path / "m", FAMILIES["llama"], seed=0, dtype="float32")
    built = build_snapshot(model_dir, BuildOptions(dtype="float32", tensor_parallel=2), BlobCache(tmp_path / "c"))
    ranks = [built.manifest.view(r) for r in range(2)]
    assert ranks[0].tensors["layers.0.qkv"] != ranks[1].tensors["layers.0.qkv"]
    for r, view in enumerate(ranks):
        assert set(view.blobs) == set(built.manifest.blob_sizes(r))
        assert isinstance(view, ManifestView) and set(view.weight_blobs()) <= set(view.blobs)
