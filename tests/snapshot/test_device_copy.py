"""Snapshot tensors onto an accelerator through staging buffers: every byte arrives, in order, in place."""

from __future__ import annotations

import pytest
import torch

from warmstart.snapshot.device_copy import copy_to_device, staged_copy


def sources() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(37, 53, generator=gen).bfloat16(),
        "int8": torch.randint(-127, 128, (1001,), generator=gen, dtype=torch.int8),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 8),
        "strided": torch.randn(16, 9, generator=gen).t(),  # not contiguous: copied as its values
    }


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 4096, 1 << 20])
def test_staged_copy_moves_every_byte(chunk_bytes: int) -> None:
    src = sources()
    dst = {name: torch.empty_like(t.contiguous()) for name, t in src.items()}
    staged_copy(src, dst, chunk_bytes, pinned=False)
    for name, t in src.items():
        assert torch.equal(dst[name], t), name


def test_mismatched_destination_and_bad_chunk_are_refused() -> None:
    with pytest.raises(ValueError, match="bytes to copy"):
        staged_copy({"a": torch.zeros(4)}, {"a": torch.zeros(3)}, 8, pinned=False)
    with pytest.raises(ValueError, match="chunk_bytes"):
        staged_copy({"a": torch.zeros(4)}, {"a": torch.zeros(4)}, 0, pinned=False)


def test_cpu_target_keeps_the_mapped_views() -> None:
    src = sources()
    assert copy_to_device(src, "cpu") is src


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_equals_the_source() -> None:
    src = sources()
    out = copy_to_device(src, "cuda", chunk_bytes=256)
    for name, t in src.items():
        assert out[name].is_cuda and torch.equal(out[name].cpu(), t), name
