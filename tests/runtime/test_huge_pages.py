"""Weights in an arena advised for transparent huge pages (runtime/models/huge_pages.py), and the prepacking that
copies the few-row kernel's plain weights into one."""

from __future__ import annotations

import mmap
import sys
import types

import pytest
import torch

from warmstart.runtime import LLM, SamplingParams
from warmstart.runtime.kernels import cpu_gemv
from warmstart.runtime.layers.linear import plain_weight
from warmstart.runtime.models import huge_pages
from warmstart.runtime.models.huge_pages import HUGE_PAGE, HugePageArena
from warmstart.runtime.models.weights import LINEAR_FIELDS

linux = pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps and MADV_HUGEPAGE are Linux's")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds ``address`` (``hg``: advised MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_keep_values_dtype_and_shape_on_page_boundaries() -> None:
    tensors = [torch.randn(37, 19).to(torch.bfloat16), torch.randn(5), torch.arange(7, dtype=torch.int64)]
    arena = HugePageArena(HugePageArena.room_for(tensors))
    copies = [arena.copy(t) for t in tensors]
    for original, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.data_ptr() % 4096 == 0 and copy.is_contiguous()
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    original = tensors[0].clone()
    copies[0].zero_()  # a copy, not a view of the original
    assert torch.equal(tensors[0], original)


def test_a_full_arena_says_so() -> None:
    arena = HugePageArena(4096)
    arena.copy(torch.zeros(HUGE_PAGE // 4))  # the size is rounded up to whole huge pages
    with pytest.raises(ValueError, match="the arena has 0 bytes left, the tensor needs 4 bytes"):
        arena.copy(torch.zeros(1))


@linux
def test_the_arena_is_advised_for_huge_pages() -> None:
    arena = HugePageArena(HUGE_PAGE)
    assert "hg" in vm_flags(arena.copy(torch.zeros(10)).data_ptr())
    assert "hg" not in vm_flags(torch.zeros(HUGE_PAGE).data_ptr())  # torch's own allocations are not


@linux
@pytest.mark.skipif(not cpu_gemv.cpu_supported(), reason="no gemv kernel here, or the kernels run below AVX2")
def test_prepacking_puts_the_kernels_weights_in_huge_pages(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    prompts, params = [[3, 17, 42, 99, 5]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def engine(**env: str):  # type: ignore[no-untyped-def]
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        llm = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16")
        assert llm.engine.prepack_thread is not None
        llm.engine.prepack_thread.join()
        weights = llm.engine.runner.model.weights
        plain = [plain_weight(getattr(layer, f)) for layer in weights.layers for f in LINEAR_FIELDS]
        return llm, plain + [plain_weight(weights.lm_head)]

    llm, plain = engine()
    assert all(w is not None and "hg" in vm_flags(w.data_ptr()) for w in plain)
    ours = llm.generate(prompts, params)[0].token_ids
    unpacked = LLM.from_hf(tiny_model_dir("llama"), dtype="bfloat16", prepack_weights=False)
    assert ours == unpacked.generate(prompts, params)[0].token_ids  # the same values, so the same tokens
    _, plain = engine(WARMSTART_CPU_GEMV="torch")  # no few-row kernel: the weights stay where they were loaded
    assert all(w is not None and "hg" not in vm_flags(w.data_ptr()) for w in plain)


def test_a_kernel_without_huge_pages_still_gets_an_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    """madvise answers EINVAL where the kernel has no transparent huge pages: the copies work in small pages."""

    class NoHugePages(mmap.mmap):
        def madvise(self, *args: int) -> None:
            raise OSError(22, "Invalid argument")

    fake = types.SimpleNamespace(mmap=NoHugePages, MAP_PRIVATE=mmap.MAP_PRIVATE, MAP_ANONYMOUS=mmap.MAP_ANONYMOUS,
                                 MADV_HUGEPAGE=14)  # fmt: skip
    monkeypatch.setattr(huge_pages, "mmap", fake)
    tensor = torch.randn(100)
    assert torch.equal(HugePageArena(HugePageArena.room_for([tensor])).copy(tensor), tensor)
