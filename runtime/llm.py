"""The offline face: ``LLM.from_hf(dir).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from warmstart.runtime.engine.engine import LLMEngine
from warmstart.runtime.engine.input_processor import Prompt
from warmstart.runtime.engine.options import EngineOptions
from warmstart.runtime.engine.pooling import embed
from warmstart.runtime.outputs import RequestOutput
from warmstart.runtime.sampling_params import SamplingParams


class LLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @classmethod
    def from_hf(
        cls, model_dir: str | Path, *, draft_model: str | Path | None = None, device: str = "auto", **options: Any
    ) -> LLM:
        """``options``: any of EngineOptions' fields by name (dtype, max_num_seqs, max_loras, ...), its defaults
        for the rest. ``device``: auto (CUDA when torch sees one, else the CPU), cpu, cuda or cuda:N; on CUDA the
        engine runs the Triton kernels and sizes its KV pool from ``gpu_memory_utilization`` of the GPU's memory.
        ``draft_model``: an HF directory for ``speculative="draft"``."""
        return cls(LLMEngine.from_hf(model_dir, EngineOptions.from_keywords(**options), draft_model, device))

    def embed(self, prompts: Prompt | Seq[Prompt], pooling: str = "last", normalize: bool = True) -> list[torch.Tensor]:
        """One embedding per prompt: its final hidden states pooled ("last" token or "mean") and, by default,
        L2-normalized (see runtime/engine/pooling.py)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return embed(self.engine, list(prompts), pooling, normalize)  # type: ignore[arg-type]

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        adapter: str | None | Seq[str | None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in the prompts' order.

        ``adapter``: one adapter name (or "auto") for every prompt, or one per prompt (None: the base model);
        requests with different adapters share each batch. Every prompt is validated before any is queued,
        so one bad prompt raises and runs nothing.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        elif not isinstance(prompts, list | tuple):
            raise ValueError(
                "prompts must be a string, a list of token ids or a list of those, "
                f"got {type(prompts).__name__}"
            )
        prompt_list: list[Prompt] = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} SamplingParams")
        adapters = [adapter] * len(prompt_list) if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(adapters) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(adapters)} adapters")
        if any(p.n != 1 for p in param_list if isinstance(p, SamplingParams)):
            raise ValueError("LLM.generate returns one output per prompt: n must be 1 (AsyncLLM.generate and "
                             "LLMEngine.add_request serve n > 1, an output per choice)")
        requests = list(zip(prompt_list, param_list, adapters, strict=True))
        for i, (prompt, p, a) in enumerate(requests):
            try:
                self.engine.inputs.make_sequence(prompt, p, f"__check_{i}", a)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        ids = [self.engine.add_request(prompt, p, adapter=a) for prompt, p, a in requests]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
