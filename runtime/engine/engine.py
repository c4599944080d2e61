"""The step loop: requests in, one scheduled batch per step, tokens and text out.

LLMEngine composes the parts that do the work: input processing (runtime/engine/input_processor.py) turns a prompt
into a Sequence, admission (admission.py) decides when it may start, the scheduler picks each step's batch, the
model runner computes it, speculation (speculative.py) proposes and verifies tokens ahead, and output processing
(output_processor.py) turns sampled tokens into text and RequestOutputs. Pinned prefixes (pinned_prefixes.py) hold
a snapshot's precomputed KV; kv_sizing.py sizes the pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from warmstart.runtime.engine.adapters import AdapterSelector, VirtualPrefix
from warmstart.runtime.engine.admission import Admission
from warmstart.runtime.engine.block_manager import BlockManager, block_hashes
from warmstart.runtime.engine.device import resolve_device
from warmstart.runtime.engine.dtype_choice import cpu_path, resolve_dtype
from warmstart.runtime.engine.input_processor import InputProcessor, Prompt
from warmstart.runtime.engine.kv_sizing import check_pool_holds_pinned, kv_blocks_for_memory
from warmstart.runtime.engine.kv_tier import KVTier
from warmstart.runtime.engine.lora import LoraManager, LoraWeights
from warmstart.runtime.engine.model_runner import ModelRunner, StepInputs
from warmstart.runtime.engine.options import AUTO, EngineOptions
from warmstart.runtime.engine.output_processor import NewTokens, OutputProcessor
from warmstart.runtime.engine.pinned_prefixes import PinnedPrefixes
from warmstart.runtime.engine.scheduler import ScheduledBatch, Scheduler
from warmstart.runtime.engine.sequence import Sequence, Status, TokenLogprobs
from warmstart.runtime.engine.speculative import DraftProposer, SpecStats, check_draft_compatible, speculation_for
from warmstart.runtime.engine.tier_link import TierLink
from warmstart.runtime.generation_config import GenerationDefaults
from warmstart.runtime.layers.linear import packing_dtype
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.models.model import Collective, Model
from warmstart.runtime.models.weights import DTYPES, ModelWeights, load_weights, prepack_in_background, weights_to
from warmstart.runtime.outputs import EngineStats, RequestOutput
from warmstart.runtime.sampling_params import SamplingParams
from warmstart.runtime.tokenizer import Tokenizer

__all__ = ["EngineOptions", "LLMEngine", "Prompt"]

TIER_IDLE_WAIT_S = 0.005  # with nothing running, a step waits this long for a KV tier lookup rather than spin


class LLMEngine:
    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer | None,
        options: EngineOptions,
        draft: Model | None = None,
        before_step: Callable[[StepInputs], None] | None = None,
        pinned_blocks: int = 0,
    ) -> None:
        """``before_step``: called with each step's inputs before it runs (rank 0 of a tensor-parallel group
        sends them to the other ranks). ``pinned_blocks``: how many blocks the caller will pin (load_prefix,
        load_adapter); a pool sized from memory gets them on top of what ``max_num_seqs`` full-length sequences
        need."""
        options.validate()
        c = model.config
        if draft is not None:
            check_draft_compatible(c, draft.config)
        self.config, self.options, self.tokenizer, self.draft = c, options, tokenizer, draft
        self.max_model_len = options.context_length(c)
        num_blocks = options.num_kv_blocks or kv_blocks_for_memory(
            c, options, self.max_model_len, draft.config if draft is not None else None, pinned_blocks,
            model.weights.embed.device)
        check_pool_holds_pinned(num_blocks, pinned_blocks, options, self.max_model_len)
        self.blocks = BlockManager(num_blocks, options.block_size, options.enable_prefix_caching)
        self.runner = ModelRunner(model, num_blocks, options.block_size, options.seed, before_step,
                                  options.max_num_seqs)
        self.speculation = speculation_for(options, draft, self.blocks, self.runner.sampler, self.max_model_len)
        self.loras = LoraManager(c, options.max_loras, options.max_lora_rank, model.dtype, self.runner.device)
        self.runner.loras = self.loras
        self.admission = Admission(self.blocks, self.loras, c.uniform_window, self.max_model_len)
        self.scheduler = Scheduler(self.blocks, options.max_num_seqs, options.max_num_batched_tokens,
                                   c.uniform_window, self.speculation.lookahead if self.speculation else None,
                                   self.admission.admit)
        self.eos_token_ids = set(c.eos_token_ids)  # shared with the processors: generation_config.json adds to it
        self.adapters: dict[str, VirtualPrefix] = {}  # compiled adapters (soft prompts), by name
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.inputs = InputProcessor(c.vocab_size, tokenizer, self.max_model_len, self.eos_token_ids, self.adapters,
                                     self.loras, self.admission, self.outputs.requests, model.weights.embed)
        proposer = self.speculation.proposer if self.speculation else None
        self.prefixes = PinnedPrefixes(c, self.blocks, self.runner, self.adapters, self.max_model_len,
                                       options.enable_prefix_caching, draft.config if draft is not None else None,
                                       proposer if isinstance(proposer, DraftProposer) else None)
        self.generation_defaults = GenerationDefaults()
        self.prompt_tokens = 0
        self.prepack_thread: threading.Thread | None = None

    @classmethod
    def from_hf(
        cls, model_dir: str | Path, options: EngineOptions | None = None, draft_dir: str | Path | None = None,
        device: str | torch.device = "auto",
    ) -> LLMEngine:  # fmt: skip
        """``device``: auto, cpu, cuda or cuda:N (see runtime/engine/device.py); the checkpoint is read on the
        host and each converted tensor moved there."""
        options = options or EngineOptions()
        options.validate()
        where = resolve_device(device)
        options = replace(options, dtype=resolve_dtype(options.dtype, where))
        config = ModelConfig.from_dir(model_dir)
        weights = weights_to(load_weights(model_dir, config, DTYPES[options.dtype]), where)
        tokenizer = Tokenizer(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
        draft = None
        if draft_dir is not None:
            draft_config = ModelConfig.from_dir(draft_dir)
            draft = (draft_config, weights_to(load_weights(draft_dir, draft_config, DTYPES[options.dtype]), where))
        engine = cls.from_weights(config, weights, tokenizer, options, draft)
        engine.use_generation_defaults(GenerationDefaults.from_dir(model_dir))
        return engine

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: ModelWeights,
        tokenizer: Tokenizer | None,
        options: EngineOptions,
        draft: tuple[ModelConfig, ModelWeights] | None = None,
        *,
        reduce: Collective | None = None,
        gather_logits: Collective | None = None,
        before_step: Callable[[StepInputs], None] | None = None,
        pinned_blocks: int = 0,
    ) -> LLMEngine:
        """From weights already in the engine's layout (a snapshot's mapped tensors), and a draft model's.
        ``reduce``, ``gather_logits`` and ``before_step`` join a tensor-parallel group (see runtime.models.model
        and runtime/engine/tensor_parallel.py); ``pinned_blocks`` as for the constructor."""
        options.validate()
        if options.dtype == AUTO:  # the weights are already in theirs
            options = replace(options, dtype=str(weights.embed.dtype).removeprefix("torch."))
        max_len = options.context_length(config)
        draft_model = None
        if draft is not None:
            check_draft_compatible(config, draft[0])
            draft_model = Model(draft[0], draft[1], max_len)
        model = Model(config, weights, max_len, reduce, gather_logits)
        engine = cls(model, tokenizer, options, draft_model, before_step, pinned_blocks)
        packs = packing_dtype(DTYPES[options.dtype]) is not None
        if options.prepack_weights and weights.embed.device.type == "cpu" and packs:
            engine.prepack_thread = prepack_in_background(weights, *([draft[1]] if draft is not None else []))
        return engine

    def use_generation_defaults(self, defaults: GenerationDefaults) -> None:
        """The model's generation_config.json: its EOS ids stop every request as config.json's do; its sampling
        is what a server gives requests that leave those fields out (see runtime/generation_config.py)."""
        self.generation_defaults = defaults
        self.eos_token_ids |= set(defaults.eos_token_ids)

    # -- requests -------------------------------------------------------------------------------------

    def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, adapter: str | None = None
    ) -> str:
        """Validate and queue one request; raises ValueError naming the bad field, queuing nothing.

        ``adapter``: a loaded adapter's name, "auto" to let the selector choose, or None for the base model."""
        seq = self.inputs.make_sequence(prompt, params, request_id, adapter)
        self.outputs.add(seq)
        self.scheduler.add(seq)
        if self.admission.tier_link is not None:
            self.admission.tier_link.on_add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, or None if it was not live."""
        entry = self.outputs.requests.get(request_id)
        if entry is None:
            return None
        seq = entry[0]
        for k in range(1, seq.params.n):  # the other choices of an n > 1 request go with it
            choice = self.outputs.requests.pop(f"{request_id}#{k}", None)
            if choice is not None:
                self._finish_choice(choice[0], "abort")
        self._finish_choice(seq, "abort")
        return self.outputs.output(seq, NewTokens(finish_reason="abort"))

    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests)

    # -- LoRA adapters (runtime/engine/lora.py) --------------------------------------------------------

    def add_lora(self, name: str, load: Callable[[], LoraWeights], rank: int) -> None:
        """Register a LoRA adapter that requests then name as ``adapter``; ``load()`` is called when a request
        first needs it and whenever it is paged back in (``max_loras`` resident, least recently used out)."""
        if name in self.adapters or name == "auto":
            raise ValueError(f"adapter name {name!r} is already taken")
        if self.runner.model.sharded:
            raise ValueError("LoRA adapters are not served with tensor parallelism yet; serve on one device")
        self.loras.add(name, load, rank)

    def remove_lora(self, name: str) -> None:
        """Forget a LoRA adapter; refused while a request uses it (abort those first, or wait for them)."""
        if name not in self.loras:
            raise ValueError(f"no LoRA adapter {str(name)[:100]!r}; loaded: {', '.join(self.loras.names()) or 'none'}")
        users = [rid for rid, (seq, _) in self.outputs.requests.items() if seq.lora == name]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} request(s); wait for them to finish")
        self.loras.remove(name)

    # -- what an engine is given after it starts ---------------------------------------------------------

    def set_adapter_selector(self, selector: AdapterSelector) -> None:
        """Let requests name adapter "auto": the selector picks one of the loaded adapters for their tokens."""
        self.inputs.adapter_selector = selector

    def attach_kv_tier(self, tier: KVTier, lookup_timeout_s: float = 2.0) -> None:
        """Keep every whole segment of computed KV in ``tier`` and load a new prompt's stored segments before it
        is admitted (see runtime/engine/tier_link.py)."""
        if not self.options.enable_prefix_caching:
            raise ValueError("the KV tier needs prefix caching (tier hits are served as prefix-cache hits)")
        if self.speculation is not None and self.speculation.drafts_with_a_model:
            raise ValueError("the KV tier holds the target model's KV only; it cannot serve a draft model's")
        if self.runner.model.sharded:
            raise ValueError("the KV tier does not support tensor parallelism yet (each rank holds part of the KV)")
        self.admission.tier_link = TierLink(tier, self.blocks, self.runner, lookup_timeout_s)

    def prefix_kv(self, token_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """Run the model over a prefix; return its full blocks' chained hashes and their KV in the pool's
        layout, [num_layers, 2, kv_heads, blocks, block_size, head_dim], for PinnedPrefixes.load_prefix. Partial
        last blocks are left out."""
        hashes = block_hashes(token_ids, self.blocks.block_size)
        self.add_request(list(token_ids), SamplingParams(max_tokens=1, ignore_eos=True))
        while self.has_unfinished():
            self.step()
        missing = [h for h in hashes if h not in self.blocks.cached]
        if missing:
            raise RuntimeError(f"{len(missing)} of the prefix's blocks were evicted; give the engine a larger pool")
        return hashes, self.runner.read_blocks([self.blocks.cached[h] for h in hashes])

    def idle_work(self) -> bool:
        """Do one piece of start-up work left for when no request runs (a decode graph); False when none is left."""
        return self.runner.capture_pending_graph()

    # -- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        tier_link = self.admission.tier_link
        if tier_link is not None:
            tier_link.poll(wait_s=0.0 if self.scheduler.running else TIER_IDLE_WAIT_S)
        batch = self.scheduler.schedule()
        if self.admission.lora_load_failed:
            return self._abort_failed_loads() + (self._step_batch(batch) if batch.seqs else [])
        return self._step_batch(batch) if batch.seqs else []

    def _abort_failed_loads(self) -> list[RequestOutput]:
        """End the requests whose adapter failed to load at admission (engine.loras.stats says why)."""
        ended = [self.abort(seq.choice_of or seq.request_id) for seq in self.admission.take_failed()
                 if seq.request_id in self.outputs.requests and not seq.is_finished]
        return [out for out in ended if out is not None]

    def _step_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        if self.speculation is not None:
            self.speculation.propose(batch)
        results = self.runner.run(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if not seq.spec_token_ids:  # a speculating sequence's progress is known after verification
                self.prompt_tokens += min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))
                seq.num_computed_tokens += n
                self.blocks.commit(seq)
                if self.speculation is not None:
                    self.blocks.trim(seq)  # slots reserved for proposals that did not come
        if self.admission.tier_link is not None:
            self.admission.tier_link.after_step(batch.seqs)
        now = time.monotonic()
        for seq, _, _ in results:
            if seq.forked_from is not None:
                self._fork(seq, now)
        return [self._emit(seq, tokens, logprobs, now) for seq, tokens, logprobs in results]

    def _emit(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None], now: float
    ) -> RequestOutput:
        new = self.outputs.append(seq, tokens, logprobs, now)
        if seq.spec_token_ids:
            assert self.speculation is not None
            self.speculation.settle(seq, len(tokens), len(new.token_ids))
        if new.finish_reason is not None:
            self._finish_choice(seq, new.finish_reason)
        return self.outputs.output(seq, new)

    def _fork(self, child: Sequence, now: float) -> None:
        """Start a choice whose first token was just sampled from its parent's prompt: sharing the prompt's
        full KV blocks and a copy of its partial last one, or (no block free for the copy) queued to compute
        what the prefix cache does not hold, as a preempted sequence is."""
        parent = child.forked_from
        assert parent is not None
        parent.forks.remove(child)
        child.forked_from = None
        child.timestamps.scheduled = now
        child.prompt_logprobs = parent.prompt_logprobs  # complete: the parent's prompt is computed
        if self.blocks.fork(parent, child):
            child.status = Status.RUNNING
            child.num_cached_tokens = parent.num_cached_tokens
            self.scheduler.running.append(child)
        else:
            self.scheduler.waiting.appendleft(child)

    def _finish_choice(self, seq: Sequence, reason: str) -> None:
        if seq.forked_from is not None:  # never scheduled: it waits for its parent's prompt
            seq.forked_from.forks.remove(seq)
            seq.forked_from = None
            seq.status, seq.finish_reason = Status.FINISHED, reason
        else:
            self.scheduler.finish(seq, reason)

    def summary(self) -> dict[str, Any]:
        """What this engine was started with and holds, for readers (the server's info and /v1/models)."""
        o = self.options
        return {"dtype": o.dtype, "block_size": self.blocks.block_size, "num_kv_blocks": self.blocks.num_blocks,
                "kv_cache_tokens": self.blocks.num_usable_blocks * self.blocks.block_size,
                "max_num_seqs": o.max_num_seqs, "max_num_batched_tokens": o.max_num_batched_tokens,
                "max_model_len": self.max_model_len, "speculative": o.speculative,
                "num_speculative_tokens": o.num_speculative_tokens, "adapters": sorted(self.adapters),
                "adapter_selector": self.inputs.adapter_selector is not None, "device": str(self.runner.device),
                "ops": self.runner.model.ops.name, **cpu_path(o.dtype, self.runner.device)}

    def stats(self) -> EngineStats:
        spec = self.speculation.stats if self.speculation is not None else SpecStats()
        tier_link = self.admission.tier_link
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.blocks.num_blocks,
            num_kv_blocks_used=self.blocks.num_used_blocks,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.outputs.generation_tokens,
            num_adapters=len(self.adapters),
            running_adapters=sorted({s.adapter for s in self.scheduler.running if s.adapter is not None}),
            waiting_adapters=sorted({s.adapter for s in self.scheduler.waiting if s.adapter is not None}),
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_num_emitted_tokens=spec.num_emitted_tokens,
            kv_tier=tier_link.tier.stats.counters(self.blocks.block_size) if tier_link else None,
        )

