"""warmstart's engine: paged KV cache, continuous batching, Llama-family decoders."""

from warmstart.runtime.async_engine import AsyncLLM, EngineDeadError
from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.llm import LLM
from warmstart.runtime.outputs import EngineStats, RequestOutput
from warmstart.runtime.sampling_params import SamplingParams

__version__ = "0.1.0"  # part of every snapshot's KV fingerprint: bump it when numerics or the KV layout change

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineDeadError",
    "EngineOptions",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
