"""Triton's compiled kernels carried between cold starts: one directory per GPU architecture, torch and triton
version, under the snapshot cache the loader names or warmstart's own, unless TRITON_CACHE_DIR says otherwise.
CUDA's answers are stubbed: what matters here is the naming."""

from __future__ import annotations

import pathlib

import pytest
import torch

import warmstart.runtime.kernels
from warmstart.runtime.kernels import (
    cache_key,
    cached_kernels,
    carried_cache_dir,
    carry_kernels_under,
    use_carried_cache,
)

GPU = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # restored after the test: the code under test sets it
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(warmstart.runtime.kernels, "_carried_base", None)
    monkeypatch.setattr(torch.version, "hip", None)


def on_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_the_key_names_the_architecture_and_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    triton = pytest.importorskip("triton")
    on_gpu(monkeypatch, (9, 0))
    assert cache_key(GPU) == f"sm90-torch{torch.__version__}-triton{triton.__version__}"
    monkeypatch.setattr(torch, "__version__", "2.99.0+cu999")
    monkeypatch.setattr(triton, "__version__", "9.9.9")
    assert cache_key(GPU) == "sm90-torch2.99.0+cu999-triton9.9.9"


def test_another_gpu_or_version_gets_another_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    on_gpu(monkeypatch, (9, 0))
    hopper = carried_cache_dir(GPU)
    on_gpu(monkeypatch, (8, 0))
    ampere = carried_cache_dir(GPU)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    newer_torch = carried_cache_dir(GPU)
    assert len({hopper, ampere, newer_torch}) == 3
    assert hopper.parent == ampere.parent == newer_torch.parent
    assert ampere.name.startswith("sm80-")


def test_the_loader_can_carry_kernels_in_its_snapshot_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    on_gpu(monkeypatch, (9, 0))
    assert carried_cache_dir(GPU).parent == tmp_path / "xdg" / "warmstart" / "triton"
    carry_kernels_under(tmp_path / "cache" / "kernels")
    assert use_carried_cache(GPU) == tmp_path / "cache" / "kernels" / cache_key(GPU)
    carried = str(tmp_path / "cache" / "kernels" / cache_key(GPU))
    assert warmstart.runtime.kernels.os.environ["TRITON_CACHE_DIR"] == carried


def test_an_image_s_own_triton_cache_dir_is_used_as_it_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "image"))
    carry_kernels_under(tmp_path / "cache" / "kernels")
    assert use_carried_cache(GPU) == tmp_path / "image"


def test_cached_kernels_counts_triton_s_directories(tmp_path: pathlib.Path) -> None:
    assert cached_kernels(tmp_path / "missing") == 0
    (tmp_path / "ABCD").mkdir()
    (tmp_path / "EFGH").mkdir()
    (tmp_path / "stray.tmp").write_text("")
    assert cached_kernels(tmp_path) == 2
