"""warmstart's engine: paged KV cache, continuous batching, Llama-family decoders.

The names below are imported on first use, so that importing a light module of the package (runtime.timeline,
which the server marks before it listens) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warmstart.runtime.async_engine import AsyncLLM, EngineDeadError
    from warmstart.runtime.engine.engine import LLMEngine
    from warmstart.runtime.engine.options import EngineOptions
    from warmstart.runtime.llm import LLM
    from warmstart.runtime.outputs import EngineStats, RequestOutput
    from warmstart.runtime.sampling_params import SamplingParams

__version__ = "0.1.0"  # part of every snapshot's KV fingerprint: bump it when numerics or the KV layout change

_HOMES = {
    "LLM": "llm",
    "AsyncLLM": "async_engine",
    "EngineDeadError": "async_engine",
    "EngineOptions": "engine.options",
    "EngineStats": "outputs",
    "LLMEngine": "engine.engine",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
}
__all__ = ["LLM", "AsyncLLM", "EngineDeadError", "EngineOptions", "EngineStats", "LLMEngine", "RequestOutput",
           "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
