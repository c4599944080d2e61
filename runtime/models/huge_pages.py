"""Weights in transparent huge pages: one anonymous mapping advised MADV_HUGEPAGE, tensors copied into it.

A decode step of one sequence reads every weight once (runtime/kernels/cpu_gemv.c), at the memory's speed; with 4 KiB
pages that stream misses the TLB every 64 cache lines. On the 2-core EPYC of docs/BENCHMARKS.md the same GEMV pass
over SmolLM2-135M's weights took 0.85x the time from 2 MiB pages, and a decode token about 0.85x. Machines whose
kernel sets transparent huge pages to ``madvise`` (the common default) give them only to memory that asks; the
snapshot's file mappings cannot ask (page-cache folios), and torch's allocations do not. Where the kernel gives none
(``never``, or no memory to spare) the copy still works, in small pages.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor on its own page boundary


class HugePageArena:
    """Room for ``nbytes`` of tensors; ``copy`` places one after the other (never freed one by one: the arena lives
    as long as any tensor in it)."""

    def __init__(self, nbytes: int) -> None:
        size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
        # one huge page more, so that the used part can start on a huge-page boundary
        self._mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
        if advice is not None:
            with contextlib.suppress(OSError):  # a kernel built without transparent huge pages: small pages then
                self._mapping.madvise(advice)
        self._bytes = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._used = (-self._bytes.data_ptr()) % HUGE_PAGE
        self._end = self._used + size

    @staticmethod
    def room_for(tensors: list[torch.Tensor]) -> int:
        """The ``nbytes`` that holds ``tensors`` with their alignment."""
        return sum(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` (same dtype and shape) in the arena."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._used + nbytes > self._end:
            raise ValueError(f"the arena has {self._end - self._used:,} bytes left, the tensor needs {nbytes:,} bytes")
        out = self._bytes[self._used : self._used + nbytes].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        return out
