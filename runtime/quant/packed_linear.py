"""bfloat16 linear layers on oneDNN's prepacked weight layout: the CPU path's matmuls.

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout on every call.
Reordering once when the engine starts measured 1.05-2.4x faster per matmul at 1-256 rows with SmolLM2-135M's
shapes (benchmarks/packed_linear.py; bf16, 2 AVX-512 cores; most at few rows), with bit-identical results, for
about 100 ms of reordering for SmolLM2-135M, done in the background after start. float32 keeps ``F.linear``,
whose arithmetic the transformers comparison pins down, and quantized weights keep their own kernels.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from runtime.models.weights import ModelWeights

LINEAR_FIELDS = ("qkv", "o_proj", "gate_up", "down")


class PackedWeight:
    """A [out_features, in_features] bf16 matrix in oneDNN's blocked layout; ``linear(x)`` is x @ W.T."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = (weight.shape[0], weight.shape[1])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # The bias goes inside the kernel, as with F.linear: added before the one rounding to bf16.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def tensors(self) -> dict[str, torch.Tensor]:
        raise TypeError("packed weights exist only inside a running engine; store the weights before packing")

    def meta(self) -> dict[str, Any]:
        raise TypeError("packed weights exist only inside a running engine; store the weights before packing")


def can_prepack(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def prepack_in_background(*models: ModelWeights) -> threading.Thread:
    """Pack the decoder's float linear layers and the head in place, one by one, on a background thread.

    The engine serves from the plain weights meanwhile and picks up each packed one at its next use (the
    results are bit-identical), so packing adds nothing to a cold start's time to ready. The embedding
    stays as it is (a lookup; a tied head gets a packed copy).
    """

    def pack_all() -> None:
        for weights in models:  # the model, then a speculative draft model if there is one
            for layer in weights.layers:
                for name in LINEAR_FIELDS:
                    w = getattr(layer, name)
                    if isinstance(w, torch.Tensor):
                        setattr(layer, name, PackedWeight(w))
            if isinstance(weights.lm_head, torch.Tensor):
                weights.lm_head = PackedWeight(weights.lm_head)

    # Not a daemon: a process that exits while a reorder is running inside oneDNN aborts (SIGABRT); at exit
    # the interpreter waits for the thread instead (a fraction of a second at most).
    thread = threading.Thread(target=pack_all, name="warmstart-prepack")
    thread.start()
    return thread
