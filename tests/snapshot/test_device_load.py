"""The loader's way onto a device, run on the CPU: weight blobs copied blob by blob through
the staging buffers (``stage_weights=True`` takes the GPU's path on the CPU), each as soon as the pull brings it
in; the engine then serves from the copies exactly what it serves from the mapped blobs; the timeline, /status
and /metrics show the copy. Devices that cannot take a snapshot are refused before anything is pulled."""

from __future__ import annotations

import functools
import inspect
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import warmstart.snapshot.loader as loader
from tests.support.serving import REF, TinySnapshot, build_tiny_snapshot
from warmstart.handlers.server.state import ServeState, load_snapshot
from warmstart.handlers.server.timeline import cold_start_timeline
from warmstart.runtime import SamplingParams
from warmstart.runtime.engine.device import DeviceError
from warmstart.runtime.kernels import isa
from warmstart.snapshot.cache import BlobCache
from warmstart.snapshot.device_copy import BlobCopier
from warmstart.snapshot.format import Manifest
from warmstart.snapshot.loader import SnapshotError, load_with_report
from warmstart.snapshot.manifest_view import ManifestView
from warmstart.snapshot.stores import open_store
from warmstart.snapshot.transfer import pull_blobs

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(3, 43))]
OPTIONS = {"num_kv_blocks": 64, "max_model_len": 256}


@pytest.fixture(scope="module")
def snap(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> TinySnapshot:  # type: ignore[no-untyped-def]
    return build_tiny_snapshot(tiny_model_dir("llama"), tmp_path_factory.mktemp("device-load"))


def weight_blobs(snap: TinySnapshot) -> dict[str, int]:
    manifest = Manifest.decode(BlobCache(snap.cache).get_manifest(snap.id) or b"")
    return {t["blob"]: manifest.data["blobs"][t["blob"]] for t in manifest.data["tensors"].values()}


def test_snapshot_load_takes_a_device() -> None:
    from warmstart import snapshot
    for face in (snapshot.load, load_with_report):
        assert inspect.signature(face).parameters["device"].default == "auto", face


# -- the copier ------------------------------------------------------------------------------------------------


def test_copier_copies_the_wanted_blobs_whole_and_ignores_the_rest() -> None:
    gen = torch.Generator().manual_seed(0)
    blobs = {f"b{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
             for i, n in enumerate((0, 1, 1000, 4096))}  # fmt: skip
    copier = BlobCopier(torch.device("cpu"), lambda blob, size: blobs[blob], chunk_bytes=333)
    copier.want({b: t.numel() for b, t in blobs.items() if b != "b3"})
    ready = [threading.Thread(target=copier.ready, args=(b,)) for b in ("b2", "b3", "b2", "nope")]
    for t in ready:
        t.start()
    for t in ready:
        t.join()
    out = copier.finish()  # b0 and b1 were never reported ready: finish copies them too
    assert sorted(out) == ["b0", "b1", "b2"]
    for b, t in out.items():
        assert torch.equal(t, blobs[b]) and (t.numel() == 0 or t.data_ptr() != blobs[b].data_ptr())
    assert copier.stats.bytes == 1001 and copier.stats.blobs == 3


def test_copier_raises_a_failed_copy_on_the_loading_thread() -> None:
    def open_blob(blob: str, size: int) -> torch.Tensor:
        raise OSError(f"{blob} is gone")

    copier = BlobCopier(torch.device("cpu"), open_blob)
    copier.want({"a": 1, "b": 2})
    copier.ready("a")
    with pytest.raises(OSError, match="a is gone"):
        copier.finish()


# -- the loader ------------------------------------------------------------------------------------------------


def test_staged_weights_serve_the_same_tokens_and_the_timeline_has_device_copy(
    snap: TinySnapshot, tmp_path: Path
) -> None:
    mapped, _ = load_with_report(snap.id, str(snap.store), snap.cache, device="cpu", **OPTIONS)
    staged, report = load_with_report(snap.id, str(snap.store), snap.cache, device="cpu", stage_weights=True,
                                      **OPTIONS)
    blobs = weight_blobs(snap)
    assert report.device == "cpu" and report.device_copy is not None
    assert report.device_copy["bytes"] == sum(blobs.values()) and report.device_copy["blobs"] == len(blobs)
    assert list(report.timeline.as_dict()["phases"]) == ["load_start", "manifest", "blobs", "device_copy", "mapped"]
    assert report.timeline.details["device_copy"] == {"device": "cpu", **report.device_copy}
    weights = staged.engine.runner.model.weights
    assert not _views_of_a_mapping(weights.layers[0].qkv)  # a copy, not the mapped blob
    assert _views_of_a_mapping(mapped.engine.runner.model.weights.layers[0].qkv)
    assert [o.token_ids for o in staged.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in mapped.generate(PROMPTS, GREEDY)
    ]


def _views_of_a_mapping(t: Any) -> bool:
    """Whether ``t`` is a view into memory torch did not allocate (torch.frombuffer over a blob's mapping)."""
    return not t.untyped_storage().resizable()


def test_each_weight_blob_is_copied_as_soon_as_the_pull_brings_it_in(
    snap: TinySnapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From an empty cache: every weight blob goes to the copier while the pull is still running, not after."""
    events: list[str] = []
    ready = BlobCopier.ready
    pull = loader.pull_snapshot

    def recording_ready(self: BlobCopier, blob: str) -> None:
        if blob in self.sizes and blob not in events:
            events.append(blob)
        ready(self, blob)

    def recording_pull(*args: Any, **kwargs: Any) -> Any:
        out = pull(*args, **kwargs)
        events.append("pull returned")
        return out

    monkeypatch.setattr(BlobCopier, "ready", recording_ready)
    monkeypatch.setattr(loader, "pull_snapshot", recording_pull)
    _, report = load_with_report(REF, str(snap.store), tmp_path / "empty-cache", device="cpu", stage_weights=True,
                                 **OPTIONS)
    assert events[-1] == "pull returned" and sorted(events[:-1]) == sorted(weight_blobs(snap))
    assert report.blobs_downloaded > 0 and report.device_copy is not None


def test_pull_reports_each_blob_once_as_it_arrives_cached_ones_first(snap: TinySnapshot, tmp_path: Path) -> None:
    store = open_store(str(snap.store))
    sizes = Manifest.decode(store.get_manifest(snap.id)).blob_sizes()
    cache = BlobCache(tmp_path / "cache")
    first = sorted(sizes)[:2]
    pull_blobs(store, cache, {b: sizes[b] for b in first})
    seen: list[str] = []
    lock = threading.Lock()

    def on_blob(blob: str) -> None:
        with lock:
            seen.append(blob)

    pull_blobs(store, cache, sizes, concurrency=4, part_size=1 << 16, on_blob=on_blob)
    assert sorted(seen) == sorted(sizes) and sorted(seen[:2]) == first


def test_serving_on_a_device_shows_the_copy_in_timeline_status_and_metrics(
    snap: TinySnapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "load_with_report", functools.partial(load_with_report, stage_weights=True))
    state = ServeState(REF, REF, cold_start_timeline())
    load_snapshot(state, str(snap.store), snap.cache, dict(OPTIONS), device="cpu")
    assert state.status == "ready", state.error
    status = state.status_json()
    copied = status["details"]["device_copy"]
    assert copied["device"] == "cpu" and copied["bytes"] == sum(weight_blobs(snap).values()) and copied["gb_per_s"] > 0
    phases = list(status["phases"])
    assert phases.index("blobs") < phases.index("device_copy") < phases.index("mapped") < phases.index("ready")
    assert status["device"] == "cpu" and status["ops"] == "torch"
    assert status["details"]["ready"]["device"] == "cpu" and status["details"]["ready"]["ops"] == "torch"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(state.metrics.render(None).decode())
               for s in family.samples}  # fmt: skip
    info = [s for family in text_string_to_metric_families(state.metrics.render(None).decode())
            for s in family.samples if s.name == "warmstart:engine_info"]  # fmt: skip
    assert [(s.labels["device"], s.labels["model_name"], s.labels["ops"], s.value) for s in info] == [
        ("cpu", "tiny", "torch", 1.0)]
    assert info[0].labels["cpu_isa"] == status["details"]["ready"]["cpu_isa"] == isa.chosen()
    assert info[0].labels["dtype"] in ("float32", "bfloat16") and info[0].labels["matmul_dtype"]
    assert samples[("warmstart:device_copy_bytes", ())] == copied["bytes"]
    assert samples[("warmstart:cold_start_seconds", (("phase", "device_copy"),))] == status["phases"]["device_copy"]
    state.shutdown()


def test_a_cpu_load_copies_nothing(snap: TinySnapshot) -> None:
    state = ServeState(REF, REF, cold_start_timeline())
    load_snapshot(state, str(snap.store), snap.cache, dict(OPTIONS), device="cpu")
    assert state.status == "ready", state.error
    assert "device_copy" not in state.status_json()["phases"] and "device_copy" not in state.status_json()
    assert "device_copy_bytes" not in state.metrics.render(None).decode()
    state.shutdown()


# -- refused before anything is pulled -------------------------------------------------------------------------


def test_a_missing_gpu_is_refused_before_the_store_is_opened(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from warmstart import snapshot
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="sees no CUDA device"):
        snapshot.load("latest", store=str(tmp_path / "no-store"), cache=tmp_path / "c", device="cuda:0")
    assert not (tmp_path / "no-store").exists() and not (tmp_path / "c").exists()


def test_nf4_is_refused_off_the_cpu_and_weights_that_do_not_fit_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    view = ManifestView({"quantized": {"layers.0.qkv": {"scheme": "int8"}, "layers.0.down": {"scheme": "nf4"}}})
    loader._check_runs_on(view, torch.device("cpu"), "3f2a")
    with pytest.raises(SnapshotError, match=r"snapshot 3f2a is quantized nf4, which has no kernel on cuda:0; serve "
                                            r"it on the CPU \(--device cpu\), or rebuild it with --quant int8 or int4"):
        loader._check_runs_on(view, torch.device("cuda", 0), "3f2a")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 << 30, 8 << 30))
    loader._check_weights_fit(torch.device("cuda", 0), 2 << 30, "3f2a")
    with pytest.raises(SnapshotError, match=r"weights are 3\.00 GiB, but cuda:0 has 2\.00 GiB free of 8\.00 GiB"):
        loader._check_weights_fit(torch.device("cuda", 0), 3 << 30, "3f2a")
