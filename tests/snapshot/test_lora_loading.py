"""A snapshot's LoRA adapters registered with the engine at load (snapshot/loader.py): each paged in from its own
verified blob when a request names it, and greedy output equal to PEFT's with that adapter, mixed with the base."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from tests.support.lora_adapters import specs
from tests.support.peft_reference import assert_matches_peft
from warmstart.runtime import LLM, SamplingParams
from warmstart.snapshot.build import BuildOptions, build_snapshot
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.loader import load
from warmstart.snapshot.store import LocalStore
from warmstart.snapshot.transfer import push_snapshot


def test_the_loader_registers_each_adapter_and_decodes_as_peft(model_dir: Path, loras: dict[str, Path],
                                                               tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "build-cache")
    built = build_snapshot(model_dir, BuildOptions(dtype="float32", loras=specs(loras, "sql", "chat")), cache)
    store = LocalStore(tmp_path / "store")
    push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    llm = load(built.id, store=store, cache=tmp_path / "serve-cache", num_kv_blocks=64, prepack_weights=False)
    assert sorted(llm.engine.loras.names()) == ["chat", "sql"]
    prompt = [5, 17, 99, 4, 250, 31]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate([prompt] * 3, params, adapter=["sql", None, "chat"])
    for out, name in zip(outs, ["sql", None, "chat"], strict=True):
        if name is not None:
            assert_matches_peft(model_dir, loras[name], prompt, out.token_ids)
    assert outs[0].token_ids != outs[1].token_ids != outs[2].token_ids




class HeldStore(LocalStore):
    """A local store whose LoRA blobs do not arrive until ``release`` is set."""

    def __init__(self, root: Path, held: set[str]) -> None:
        super().__init__(root)
        self.held, self.release = held, threading.Event()

    def stream_range(self, blob: str, start: int, end: int) -> Iterator[bytes]:
        if blob in self.held:
            self.release.wait()
        return super().stream_range(blob, start, end)


def test_a_cold_start_leaves_lora_blobs_in_the_store_until_an_adapter_is_paged_in(
        model_dir: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    built = build_snapshot(model_dir, BuildOptions(dtype="float32", loras=specs(loras, "sql", "chat")),
                           BlobCache(tmp_path / "build-cache"))
    blobs = {e["name"]: e["blob"] for e in built.manifest.data["loras"]}
    store = HeldStore(tmp_path / "store", set(blobs.values()))
    push_snapshot(store, built.manifest.encode(), built.id, built.blob_paths)
    cache = BlobCache(tmp_path / "serve-cache")
    loaded: list[LLM] = []
    loading = threading.Thread(target=lambda: loaded.append(load(built.id, store=store, cache=cache,
                                                                 num_kv_blocks=64, prepack_weights=False)))
    loading.start()
    loading.join(timeout=60)
    try:
        assert loaded, "the load waited for the LoRA blobs"
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        assert len(loaded[0].generate([[5, 6, 7]], params)[0].token_ids) == 3  # the base serves meanwhile
        assert not any(cache.has(b) for b in blobs.values())
    finally:
        store.release.set()
    llm = loaded[0]
    out = llm.generate([[5, 17, 99, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       adapter="sql")[0]
    assert_matches_peft(model_dir, loras["sql"], [5, 17, 99, 4], out.token_ids)
    assert cache.has(blobs["sql"]) and not cache.has(blobs["chat"])  # only the adapter asked for
    assert cache.get_manifest(built.id) is None  # cached once every blob is in
    llm.generate([[5, 6]], SamplingParams(max_tokens=1), adapter="chat")
    assert cache.get_manifest(built.id) is not None
