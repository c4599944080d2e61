"""warmstart's engine: paged KV cache, continuous batching, Llama-family decoders."""

from runtime.async_engine import AsyncLLM, EngineDeadError
from runtime.engine.engine import LLMEngine
from runtime.engine.options import EngineOptions
from runtime.llm import LLM
from runtime.outputs import EngineStats, RequestOutput
from runtime.sampling_params import SamplingParams

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
