"""What an engine is started with: the options a server's flags and LLM's keywords set, checked in one place.

The defaults are here only: the CLI's flags and help read them from this class, which imports no torch (the serve
command builds its parser before it listens)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warmstart.runtime.models.config import ModelConfig

AUTO = "auto"  # the dtype chosen for the device (runtime/engine/dtype_choice.py)
SPECULATIVE_METHODS = (None, "ngram", "draft")


@dataclass
class EngineOptions:
    dtype: str = "auto"  # or bfloat16, float16, float32 (runtime/engine/dtype_choice.py)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size the pool from available memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_memory_fraction: float = 0.25  # of available memory, when sizing the pool on the CPU
    # On CUDA: the fraction of the GPU's total memory this engine may use, weights and all (vLLM's meaning); the
    # pool gets what is left of it after the weights and an activation reserve (see kv_blocks_for_memory).
    gpu_memory_utilization: float = 0.9
    seed: int | None = None  # for requests without a seed of their own
    prepack_weights: bool = True  # bf16 on CPU: reorder linear weights once for oneDNN (see packed_linear)
    speculative: str | None = None  # "ngram" (prompt lookup) or "draft" (a draft model); None: off
    num_speculative_tokens: int = 4  # proposals verified per decoding sequence and step
    # Per sequence, k follows its acceptance (speculative.adapt_k); measured faster at partial acceptance and
    # the same at full acceptance (benchmarks/speculative.py --adaptive, docs/BENCHMARKS.md).
    adaptive_speculation: bool = True
    # LoRA adapters served unmerged (runtime/engine/lora.py): how many are resident on the device at once (their
    # slots are allocated with the first adapter added), and the largest rank served.
    max_loras: int = 4
    max_lora_rank: int = 16

    @classmethod
    def from_keywords(cls, **keywords: Any) -> EngineOptions:
        """Options named as the fields are (LLM.from_hf's keywords); an unknown name is refused, naming the known."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(keywords) - set(known))
        if unknown:
            names = ", ".join(map(repr, unknown))
            raise ValueError(f"unknown engine option {names}; the options are {', '.join(known)}")
        return cls(**keywords)

    def context_length(self, config: ModelConfig) -> int:
        """The longest sequence the engine serves: max_model_len, capped by the model's positions."""
        return min(self.max_model_len or config.max_position_embeddings, config.max_position_embeddings)

    def validate(self) -> None:
        from warmstart.runtime.models.weights import DTYPES

        if self.dtype not in (AUTO, *DTYPES):
            raise ValueError(f"dtype must be one of {AUTO}, {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of 'ngram', 'draft' or None, got {self.speculative!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:  # NaN too
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
