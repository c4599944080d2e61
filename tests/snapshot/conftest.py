"""Fixtures of the snapshot tests of LoRA blobs and their loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.lora_adapters import LORAS
from tests.support.peft_reference import make_adapter


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("llama")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def loras(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(model_dir, root / name, "LoraConfig", seed=i, **opts)
            for i, (name, opts) in enumerate(LORAS.items())}
