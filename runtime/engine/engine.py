"""The step loop: requests in, one scheduled batch per step, tokens and text out."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from runtime.engine.adapters import AdapterSelector, VirtualPrefix, virtual_token_ids
from runtime.engine.block_manager import NO_PARENT, BlockManager, block_hashes, salted_root
from runtime.engine.cuda_graphs import DEFAULT_BATCH_SIZES
from runtime.engine.device import cuda_memory, resolve_device
from runtime.engine.dtype_choice import AUTO, cpu_path, resolve_dtype
from runtime.engine.kv_tier import KVTier
from runtime.engine.lora import LoraLoadError, LoraManager, LoraStats, LoraWeights
from runtime.engine.model_runner import ModelRunner, StepInputs
from runtime.engine.scheduler import ScheduledBatch, Scheduler
from runtime.engine.sequence import Sequence, Status, Timestamps, TokenLogprobs
from runtime.engine.speculative import DraftProposer, NgramProposer, Proposer, SpecStats, adapt_k, lookahead
from runtime.engine.structured import GrammarCompiler, compiler_for
from runtime.engine.tier_link import TierLink
from runtime.generation_config import GenerationDefaults
from runtime.layers.linear import packing_dtype
from runtime.models.config import ModelConfig
from runtime.models.model import Collective, Model
from runtime.models.weights import DTYPES, ModelWeights, load_weights, prepack_in_background, weights_to
from runtime.outputs import EngineStats, RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.tokenizer import Detokenizer, Tokenizer

Prompt = str | list[int]

SPECULATIVE_METHODS = (None, "ngram", "draft")
TIER_IDLE_WAIT_S = 0.005  # with nothing running, a step waits this long for a KV tier lookup rather than spin


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

    def context_length(self, config: ModelConfig) -> int:
        """The longest sequence the engine serves: max_model_len, capped by the model's positions."""
        return min(self.max_model_len or config.max_position_embeddings, config.max_position_embeddings)

    def validate(self) -> None:
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
        self.draft = draft
        if draft is not None:
            check_draft_compatible(c, draft.config)
        self.config = c
        self.options = options
        self.tokenizer = tokenizer
        self.max_model_len = options.context_length(c)
        num_blocks = options.num_kv_blocks or self._blocks_from_memory(pinned_blocks, model.weights.embed.device)
        check_pool_holds_pinned(num_blocks, pinned_blocks, options, self.max_model_len)
        self.blocks = BlockManager(num_blocks, options.block_size, options.enable_prefix_caching)
        self.runner = ModelRunner(model, num_blocks, options.block_size, options.seed, before_step,
                                  options.max_num_seqs)
        self.proposer: Proposer | None = None
        if options.speculative == "ngram":
            self.proposer = NgramProposer()
        elif options.speculative == "draft":
            if draft is None:
                raise ValueError("speculative='draft' needs a draft model (build the snapshot with --draft DIR)")
            self.proposer = DraftProposer(draft, self.blocks, self.runner.sampler)
        self.scheduler = Scheduler(
            self.blocks,
            options.max_num_seqs,
            options.max_num_batched_tokens,
            c.uniform_window,
            self._lookahead if self.proposer is not None else None,
            self._admit,
        )
        self.spec = SpecStats()
        self.requests: dict[str, tuple[Sequence, Detokenizer | None]] = {}
        self.eos_token_ids = set(c.eos_token_ids)
        self.generation_defaults = GenerationDefaults()
        self._ids = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prepack_thread: threading.Thread | None = None
        self.adapters: dict[str, VirtualPrefix] = {}
        self.adapter_selector: AdapterSelector | None = None
        self.loras = LoraManager(c, options.max_loras, options.max_lora_rank, model.dtype, self.runner.device)
        self.runner.loras = self.loras
        self.lora_load_failed: list[Sequence] = []  # waiting sequences whose adapter failed to load: aborted next
        self.tier_link: TierLink | None = None

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
        seq = self.make_sequence(prompt, params, request_id, adapter)
        for choice in [seq, *self._choices(seq)]:
            detok = None
            if self.tokenizer is not None:
                ends = seq.stop_token_ids | (frozenset() if params.ignore_eos else self.eos_token_ids)
                detok = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                    seq.prompt_token_ids, params.skip_special_tokens, ends)
            self.requests[choice.request_id] = (choice, detok)
        self.scheduler.add(seq)
        if self.tier_link is not None:
            self.tier_link.on_add(seq)
        return seq.request_id

    def _choices(self, seq: Sequence) -> list[Sequence]:
        """For n > 1: choices 1..n-1 of ``seq``'s request, waiting in seq.forks for its prompt to be computed.
        Each draws from its own generator: seed + index when the request has a seed."""
        p = seq.params
        if p.n == 1:
            return []
        seq.choice_of = seq.request_id
        for k in range(1, p.n):
            child = Sequence(f"{seq.request_id}#{k}", list(seq.token_ids), seq.num_prompt_tokens, p,
                             stop_token_ids=seq.stop_token_ids, min_tokens_banned=seq.min_tokens_banned,
                             timestamps=Timestamps(seq.timestamps.arrival), adapter=seq.adapter,
                             num_virtual_tokens=seq.num_virtual_tokens, virtual_tail_block=seq.virtual_tail_block,
                             lora=seq.lora, hash_root=seq.hash_root, index=k, choice_of=seq.request_id,
                             forked_from=seq)
            if p.seed is not None:
                child.generator = torch.Generator().manual_seed((p.seed + k) % 2**64)
            if seq.grammar is not None:  # structured outputs: each choice advances its own matcher
                child.grammar = seq.grammar.fork()
            seq.forks.append(child)
        return seq.forks

    def make_sequence(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, adapter: str | None = None
    ) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests or f"{request_id}#1" in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        vocab = self.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            bad = next(t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        prefix = self.resolve_adapter(adapter, token_ids)
        if prefix is not None:
            token_ids = prefix.token_ids + token_ids
        lora = adapter if adapter in self.loras else None
        hash_root = salted_root(self.loras.hash_root(lora) if lora is not None else NO_PARENT, params.cache_salt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; the context is {self.max_model_len} tokens "
                "(shorten the prompt or raise max_model_len)"
            )
        self._check_fits_pool(token_ids, params.max_tokens, hash_root)
        seq = Sequence(request_id, list(token_ids), len(token_ids), params, lora=lora, adapter=lora,
                       hash_root=hash_root)
        seq.stop_token_ids = frozenset(params.stop_token_ids)
        if params.structured_outputs is not None:
            seq.grammar = self.grammar_compiler().matcher(params.structured_outputs)
        self._check_processing_ids(params)
        if params.min_tokens:
            seq.min_tokens_banned = seq.stop_token_ids | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if prefix is not None:
            seq.adapter, seq.num_virtual_tokens = prefix.name, prefix.num_tokens
            seq.virtual_tail_block = prefix.tail_block
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        return seq

    def _check_processing_ids(self, params: SamplingParams) -> None:
        vocab = self.config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                          ("bad_words_token_ids", [t for w in params.bad_words_token_ids for t in w])):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab})")

    def grammar_compiler(self) -> GrammarCompiler:
        """Structured outputs' compiler for this model's tokenizer (made, and the grammar engine imported, on the
        first constrained request)."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        if not self.eos_token_ids:
            raise ValueError("structured outputs need the model's EOS token to end the output; its config has none")
        return compiler_for(self.tokenizer, self.config.vocab_size, sorted(self.eos_token_ids))

    def kv_room(self, token_ids: list[int], adapter: str | None = None) -> int:
        """How many tokens may follow a prompt in the KV pool with every other request gone: admission's bound
        on max_tokens, before the context's. ``adapter`` as for add_request (its virtual tokens lead the prompt).
        Safe to call from another thread than the step loop's: what it reads of the pool, the pinned blocks,
        never changes once they are loaded."""
        prefix = self.resolve_adapter(adapter, token_ids)
        root = self.loras.hash_root(adapter) if adapter is not None and adapter in self.loras else NO_PARENT
        return self._kv_room(token_ids if prefix is None else prefix.token_ids + token_ids, root)

    def _kv_room(self, token_ids: list[int], root: int = NO_PARENT) -> int:
        bs, usable = self.blocks.block_size, self.blocks.num_usable_blocks
        window = self.config.uniform_window
        if window and -(-(window + 1) // bs) + 1 <= usable:
            return self.max_model_len  # a sequence never holds more than the window's blocks plus the one written
        # The blocks of a pinned prefix the prompt starts with are shared: never taken from the free pool.
        return (usable + self.blocks.pinned_prefix_blocks(token_ids, root)) * bs - len(token_ids)

    def _check_fits_pool(self, token_ids: list[int], max_tokens: int, root: int = NO_PARENT) -> None:
        """Refuse a request that could never be scheduled: one needing more blocks than can ever be free for
        it, even with every other request gone. Accepted, it would wait forever and hold up the queue."""
        room = self._kv_room(token_ids, root)
        if min(len(token_ids) + max_tokens, self.max_model_len) - len(token_ids) <= room:
            return
        usable, num_blocks = self.blocks.num_usable_blocks, self.blocks.num_blocks
        pinned = num_blocks - usable
        held = f", {pinned} of them pinned by snapshot prefixes and adapters" if pinned else ""
        advice = f"lower max_tokens to at most {room}" if room >= 1 else "shorten the prompt"
        raise ValueError(
            f"the prompt is {len(token_ids)} tokens and max_tokens {max_tokens}, but at most {room} tokens can follow "
            f"this prompt in the KV pool: {usable} of its {num_blocks} blocks of {self.blocks.block_size} tokens can "
            f"ever be free for one request{held}; {advice}, or raise num_kv_blocks (serve --num-kv-blocks)"
        )

    def resolve_adapter(self, name: str | None, token_ids: list[int]) -> VirtualPrefix | None:
        """The compiled adapter a request names ("auto": the selector's choice for its tokens), or None for none
        or a LoRA adapter (see add_lora)."""
        if name is None or name in self.loras:
            return None
        if name == "auto":
            name = self.select_adapter(token_ids)
        if name not in self.adapters:
            known = ", ".join(sorted([*self.adapters, *self.loras.names()])) or "none"
            raise ValueError(f"unknown adapter {str(name)[:100]!r}; this engine's adapters: {known}")
        return self.adapters[name]

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
        users = [rid for rid, (seq, _) in self.requests.items() if seq.lora == name]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} request(s); wait for them to finish")
        self.loras.remove(name)

    def list_loras(self) -> list[str]:
        return self.loras.names()

    def lora_stats(self) -> LoraStats:
        return self.loras.stats

    def _admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether a waiting sequence may start: its KV tier lookup is over, and its LoRA adapter has a slot."""
        if self.tier_link is not None and not self.tier_link.ready(seq):
            return False
        if seq.lora is None:
            return True
        try:
            return self.loras.acquire(seq.lora, {s.lora for s in running if s.lora is not None})
        except LoraLoadError:  # not the engine's failure: the request ends (see _abort_failed_loads)
            self.lora_load_failed.append(seq)
            return False

    def _abort_failed_loads(self) -> list[RequestOutput]:
        """End the requests whose adapter failed to load at admission (engine.loras.stats says why)."""
        outputs = []
        for seq in self.lora_load_failed:
            if seq.request_id in self.requests and not seq.is_finished:
                outputs.append(self.abort(seq.choice_of or seq.request_id))
        self.lora_load_failed = []
        return [out for out in outputs if out is not None]

    def set_adapter_selector(self, selector: AdapterSelector) -> None:
        """Let requests name adapter "auto": the selector picks one of the loaded adapters for their tokens."""
        self.adapter_selector = selector

    def select_adapter(self, token_ids: list[int]) -> str:
        """The selector's adapter for a query's tokens (see runtime.adapters.AdapterSelector)."""
        if self.adapter_selector is None:
            raise ValueError("adapter 'auto' needs a selector; build the snapshot with --adapter-examples")
        return self.adapter_selector.select(token_ids, self.runner.model.weights.embed)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("prompt is text but this model has no tokenizer.json; send token ids instead")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        return token_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, or None if it was not live."""
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return None
        seq, detok = entry
        for k in range(1, seq.params.n):  # the other choices of an n > 1 request go with it
            choice = self.requests.pop(f"{request_id}#{k}", None)
            if choice is not None:
                self._finish_choice(choice[0], "abort")
        self._finish_choice(seq, "abort")
        return self._output(seq, detok, [], detok.flush() if detok else "")

    def _finish_choice(self, seq: Sequence, reason: str) -> None:
        if seq.forked_from is not None:  # never scheduled: it waits for its parent's prompt
            seq.forked_from.forks.remove(seq)
            seq.forked_from = None
            seq.status, seq.finish_reason = Status.FINISHED, reason
        else:
            self.scheduler.finish(seq, reason)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def idle_work(self) -> bool:
        """Do one piece of start-up work left for when no request runs (a decode graph); False when none is left."""
        return self.runner.capture_pending_graph()

    # -- the KV tier ------------------------------------------------------------------------------------

    def attach_kv_tier(self, tier: KVTier, lookup_timeout_s: float = 2.0) -> None:
        """Keep every whole segment of computed KV in ``tier`` and load a new prompt's stored segments before it
        is admitted (see runtime/engine/tier_link.py)."""
        if not self.options.enable_prefix_caching:
            raise ValueError("the KV tier needs prefix caching (tier hits are served as prefix-cache hits)")
        if isinstance(self.proposer, DraftProposer):
            raise ValueError("the KV tier holds the target model's KV only; it cannot serve a draft model's")
        if self.runner.model.sharded:
            raise ValueError("the KV tier does not support tensor parallelism yet (each rank holds part of the KV)")
        self.tier_link = TierLink(tier, self.blocks, self.runner, lookup_timeout_s)

    # -- precomputed prefixes (snapshots) -----------------------------------------------------------------

    def prefix_kv(self, token_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """Run the model over a prefix; return its full blocks' chained hashes and their KV in the pool's
        layout, [num_layers, 2, kv_heads, blocks, block_size, head_dim]. Partial last blocks are left out."""
        hashes = block_hashes(token_ids, self.blocks.block_size)
        self.add_request(list(token_ids), SamplingParams(max_tokens=1, ignore_eos=True))
        while self.has_unfinished():
            self.step()
        missing = [h for h in hashes if h not in self.blocks.cached]
        if missing:
            raise RuntimeError(f"{len(missing)} of the prefix's blocks were evicted; give the engine a larger pool")
        return hashes, self.runner.read_blocks([self.blocks.cached[h] for h in hashes])

    def load_prefix(
        self, token_ids: list[int], hashes: list[int], kv: torch.Tensor, draft_kv: torch.Tensor | None = None
    ) -> None:
        """Put a precomputed prefix's blocks (see prefix_kv) into the pool, pinned and findable by the prefix
        cache, so that a request starting with ``token_ids`` is served them as a cache hit. ``draft_kv``,
        the draft model's prefix_kv for the same tokens, goes into the draft's pool for the same blocks."""
        bs = self.blocks.block_size
        _check_prefix_shape(self.config, kv, len(hashes), bs, len(token_ids))
        if draft_kv is not None and self.draft is not None:
            _check_prefix_shape(self.draft.config, draft_kv, len(hashes), bs, len(token_ids))
        if hashes != block_hashes(token_ids, bs)[: len(hashes)]:
            raise ValueError("prefix block hashes do not match its token ids")
        if not self.options.enable_prefix_caching or not hashes:
            return
        blocks = self._take_pinned(len(hashes), f"a prefix of {len(token_ids)} tokens")
        self.runner.fill_blocks(blocks, kv)
        if draft_kv is not None and isinstance(self.proposer, DraftProposer):
            self.proposer.loaded(blocks, hashes, draft_kv)
        self._register_chain(blocks, hashes, token_ids)

    def _register_chain(self, blocks: list[int], hashes: list[int], token_ids: list[int]) -> None:
        """Make pinned, filled blocks findable by the prefix cache under their chained hashes."""
        bs = self.blocks.block_size
        parent = NO_PARENT
        for i, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
            self.blocks.register(block, block_hash, tuple(token_ids[i * bs : (i + 1) * bs]), parent)
            parent = block_hash

    def _take_pinned(self, count: int, what: str) -> list[int]:
        free = self.blocks.num_free_blocks
        if count > free:
            pinned = self.blocks.num_blocks - self.blocks.num_usable_blocks
            raise ValueError(
                f"{what} needs {count} KV blocks pinned, but only {free} of the pool's {self.blocks.num_blocks} are "
                f"free ({pinned} already pinned): raise num_kv_blocks (serve --num-kv-blocks) to at least "
                f"{pinned + count + self._blocks_per_sequence()}, or leave it unset to size the pool from memory"
            )
        return self.blocks.take_pinned(count)

    def _blocks_per_sequence(self) -> int:
        return -(-self.max_model_len // self.blocks.block_size)

    def virtual_tokens_kv(self, embeds: torch.Tensor) -> torch.Tensor:
        """KV of soft-prompt embeddings [n, hidden] at positions 0..n-1, in the pool's block layout (the last
        block zero-padded): what ``load_adapter`` takes."""
        seq = Sequence("virtual-tokens", [], 0, SamplingParams(max_tokens=1))
        seq.block_table = self.blocks.take_free(-(-embeds.shape[0] // self.blocks.block_size))
        try:
            return self.runner.virtual_tokens_kv(embeds, seq.block_table)
        finally:
            self.blocks.free_seq(seq)

    def load_adapter(self, name: str, kind: str, num_tokens: int, kv: torch.Tensor) -> VirtualPrefix:
        """Put an adapter's KV, [num_layers, 2, kv_heads, blocks, block_size, head_dim] for ``num_tokens``
        virtual positions, into pinned pool blocks; requests then name it (see runtime/engine/adapters.py)."""
        c, bs = self.config, self.blocks.block_size
        num_blocks = -(-num_tokens // bs)
        expected = (c.num_layers, 2, c.num_kv_heads, num_blocks, bs, c.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"adapter {name!r}: KV of shape {tuple(kv.shape)}; expected {expected}")
        if name in self.adapters or name == "auto":
            raise ValueError(f"adapter name {name!r} is already taken")
        token_ids = virtual_token_ids(name, num_tokens)
        blocks = self._take_pinned(num_blocks, f"adapter {name!r}")
        self.runner.fill_blocks(blocks, kv)
        hashes = block_hashes(token_ids, bs)  # full blocks only: a partial tail block is copied, never shared
        self._register_chain(blocks[: len(hashes)], hashes, token_ids)
        tail = blocks[-1] if num_tokens % bs else None
        self.adapters[name] = VirtualPrefix(name, kind, token_ids, tail)
        return self.adapters[name]

    # -- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.tier_link is not None:
            self.tier_link.poll(wait_s=0.0 if self.scheduler.running else TIER_IDLE_WAIT_S)
        batch = self.scheduler.schedule()
        if self.lora_load_failed:
            return self._abort_failed_loads() + (self._step_batch(batch) if batch.seqs else [])
        if not batch.seqs:
            return []
        return self._step_batch(batch)

    def _step_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        if self.proposer is not None:
            self._propose(batch)
        results = self.runner.run(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if not seq.spec_token_ids:  # a speculating sequence's progress is known after verification
                self.prompt_tokens += min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))
                seq.num_computed_tokens += n
                self.blocks.commit(seq)
                if self.proposer is not None:
                    self.blocks.trim(seq)  # slots reserved for proposals that did not come
        if self.tier_link is not None:
            self.tier_link.after_step(batch.seqs)
        now = time.monotonic()
        for seq, _, _ in results:
            if seq.forked_from is not None:
                self._fork(seq, now)
        return [self._emit(seq, tokens, logprobs, now) for seq, tokens, logprobs in results]

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

    def _lookahead(self, seq: Sequence) -> int:
        # The draft model holds no adapter's KV (adapters are compiled for the target), so requests behind an
        # adapter are verified only by prompt lookup.
        if seq.adapter is not None and isinstance(self.proposer, DraftProposer):
            return 0
        if seq.grammar is not None:  # proposals are not checked against its grammar: it never speculates
            return 0
        return lookahead(seq, self.options.num_speculative_tokens, self.max_model_len)

    def _propose(self, batch: ScheduledBatch) -> None:
        """Fill the speculative slots the scheduler gave decoding sequences; shrink them to the proposals."""
        seqs, limits, rows = [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            room = n - (seq.num_tokens - seq.num_computed_tokens)
            if room > 0:
                seqs.append(seq)
                limits.append(room)
                rows.append(i)
        if not seqs:
            return
        assert self.proposer is not None
        self.proposer.propose(seqs, limits)
        for seq, i in zip(seqs, rows, strict=True):
            batch.num_tokens[i] = 1 + len(seq.spec_token_ids)

    def _emit(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None], now: float
    ) -> RequestOutput:
        """Append a sequence's new tokens one by one, up to the first that finishes it."""
        detok = self.requests[seq.request_id][1]
        text = ""
        emitted: list[int] = []
        reason = None
        stopped = False
        for token, lp in zip(tokens, logprobs, strict=True):
            seq.token_ids.append(token)
            emitted.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            self.generation_tokens += 1
            if lp is not None:
                seq.logprobs.append(lp)
            if seq.timestamps.first_token is None:
                seq.timestamps.first_token = now
            delta = detok.add(token) if detok else None
            stopped = delta is not None and delta.stopped
            reason = "stop" if stopped else self._finish_reason(seq, token)
            text += delta.text if delta else ""
            if reason is not None:
                break
        if seq.spec_token_ids:
            self._settle_speculation(seq, len(tokens), len(emitted))
        if reason is not None:
            self._finish_choice(seq, reason)
            del self.requests[seq.request_id]
            if detok is not None and not stopped:
                text += detok.flush()
        return self._output(seq, detok, emitted, text)

    def _settle_speculation(self, seq: Sequence, num_tokens: int, num_kept: int) -> None:
        """Count the verification, then roll back: the sequence's KV is good up to its last accepted token
        (a finishing sequence keeps fewer); later slots' blocks go back to the pool."""
        self.spec.num_drafts += 1
        self.spec.num_draft_tokens += len(seq.spec_token_ids)
        self.spec.num_accepted_tokens += num_tokens - 1
        self.spec.num_emitted_tokens += num_tokens
        if self.options.adaptive_speculation:
            adapt_k(seq, len(seq.spec_token_ids), num_tokens - 1, self.options.num_speculative_tokens)
        seq.num_computed_tokens += num_kept
        seq.spec_token_ids = []
        seq.spec_probs = None
        self.blocks.commit(seq)
        self.blocks.trim(seq)
        assert self.proposer is not None
        self.proposer.verified(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in seq.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.grammar is not None and seq.grammar.finished:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(
        self, seq: Sequence, detok: Detokenizer | None, new_tokens: list[int], new_text: str
    ) -> RequestOutput:
        finished = seq.is_finished
        text = ""
        if detok is not None:
            text = detok.text[: detok.emitted]
        return RequestOutput(
            request_id=seq.choice_of or seq.request_id,
            index=seq.index,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            cached_tokens=max(0, seq.num_cached_tokens - seq.num_virtual_tokens),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            new_token_ids=new_tokens,
            new_text=new_text,
            timestamps=seq.timestamps,
            adapter=seq.adapter,
        )

    def summary(self) -> dict[str, Any]:
        """What this engine was started with and holds, for readers (the server's info and /v1/models)."""
        o = self.options
        return {"dtype": o.dtype, "block_size": self.blocks.block_size, "num_kv_blocks": self.blocks.num_blocks,
                "kv_cache_tokens": self.blocks.num_usable_blocks * self.blocks.block_size,
                "max_num_seqs": o.max_num_seqs, "max_num_batched_tokens": o.max_num_batched_tokens,
                "max_model_len": self.max_model_len, "speculative": o.speculative,
                "num_speculative_tokens": o.num_speculative_tokens, "adapters": sorted(self.adapters),
                "adapter_selector": self.adapter_selector is not None, "device": str(self.runner.device),
                "ops": self.runner.model.ops.name, **cpu_path(o.dtype, self.runner.device)}

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.blocks.num_blocks,
            num_kv_blocks_used=self.blocks.num_used_blocks,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_adapters=len(self.adapters),
            running_adapters=sorted({s.adapter for s in self.scheduler.running if s.adapter is not None}),
            waiting_adapters=sorted({s.adapter for s in self.scheduler.waiting if s.adapter is not None}),
            spec_num_drafts=self.spec.num_drafts,
            spec_num_draft_tokens=self.spec.num_draft_tokens,
            spec_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_num_emitted_tokens=self.spec.num_emitted_tokens,
            kv_tier=self.tier_link.tier.stats.counters(self.blocks.block_size) if self.tier_link else None,
        )

    def _blocks_from_memory(self, pinned_blocks: int, device: torch.device) -> int:
        return kv_blocks_for_memory(self.config, self.options, self.max_model_len,
                                    self.draft.config if self.draft is not None else None, pinned_blocks, device)


# Kept beside the pool on CUDA for what the estimate of activation_reserve leaves out: cuBLAS workspaces, the
# caching allocator's rounding and fragmentation. An estimate, not a measurement: benchmarks/gpu_check.py
# records what a GPU really has left.
CUDA_WORKSPACE_BYTES = 256 << 20


def kv_blocks_for_memory(
    c: ModelConfig, o: EngineOptions, max_model_len: int, draft: ModelConfig | None = None, pinned_blocks: int = 0,
    device: torch.device | None = None,
) -> int:  # fmt: skip
    """How many KV blocks the pool gets when ``num_kv_blocks`` is not given, never more than ``max_num_seqs``
    full-length sequences could use beside the ``pinned_blocks``. On the CPU: a fraction of available memory.
    On CUDA (``device``, with the weights already on it): what ``gpu_memory_utilization`` of the GPU leaves after
    the weights and the activation reserve; a pool that cannot hold one ``max_model_len`` sequence beside the
    pinned blocks is refused, saying what to change."""
    block_bytes = kv_block_bytes(c, o, draft)
    useful = o.max_num_seqs * -(-max_model_len // o.block_size) + pinned_blocks  # more could never be used
    if device is None or device.type != "cuda":
        budget = int(_available_memory() * o.kv_cache_memory_fraction)
        return max(1, min(budget // block_bytes, useful))
    memory = cuda_memory(device, o.gpu_memory_utilization, activation_reserve(c, o))
    blocks = memory.budget // block_bytes
    check_pool_fits_a_sequence(blocks, block_bytes, pinned_blocks, o, max_model_len, f"on {device}: {memory.explain()}")
    return min(blocks, useful)


def _element_size(o: EngineOptions) -> int:
    # "auto" not yet resolved (a size estimate before the engine exists): bfloat16's, what it resolves to wherever
    # the kernels have a vector path (runtime/engine/dtype_choice.py)
    return torch.empty((), dtype=DTYPES["bfloat16" if o.dtype == AUTO else o.dtype]).element_size()


def kv_block_bytes(c: ModelConfig, o: EngineOptions, draft: ModelConfig | None = None) -> int:
    elem = _element_size(o)
    block_bytes = 2 * c.num_layers * o.block_size * c.num_kv_heads * c.head_dim * elem
    if draft is not None:  # a block id holds KV in the draft's pool too
        block_bytes += 2 * draft.num_layers * o.block_size * draft.num_kv_heads * draft.head_dim * elem
    return block_bytes


def activation_reserve(c: ModelConfig, o: EngineOptions) -> int:
    """Bytes a step's activations may need at their peak on CUDA, kept out of the KV pool: one layer's
    tensors for a full step of ``max_num_batched_tokens`` (the residual stream, the normed input, QKV, the
    attention output, gate/up and its product), the logits of the rows a step samples (in the model's dtype
    and in float32), the same for the largest captured decode graph, and CUDA_WORKSPACE_BYTES."""
    elem = _element_size(o)
    per_token = 3 * c.hidden_size + 2 * c.q_size + 2 * c.kv_size + 3 * c.intermediate_size
    per_logits_row = c.vocab_size * (elem + 4)
    proposals = o.num_speculative_tokens if o.speculative else 0
    logits_rows = min(o.max_num_batched_tokens, o.max_num_seqs * (1 + proposals))
    graph_rows = max(DEFAULT_BATCH_SIZES)
    step = o.max_num_batched_tokens * per_token * elem + logits_rows * per_logits_row
    graphs = graph_rows * (per_token * elem + per_logits_row)
    return step + graphs + CUDA_WORKSPACE_BYTES


def check_pool_fits_a_sequence(
    blocks: int, block_bytes: int, pinned_blocks: int, o: EngineOptions, max_model_len: int, where: str
) -> None:
    """Refuse a pool sized from a GPU's memory that could not hold one full-length sequence beside the pinned
    blocks: every request would be refused or wait forever, so the server must not start."""
    per_sequence = -(-max_model_len // o.block_size)
    if blocks >= pinned_blocks + per_sequence:
        return
    fits = max(0, blocks - pinned_blocks) * o.block_size
    pinned = f" beside the {pinned_blocks} that snapshot prefixes and adapters pin" if pinned_blocks else ""
    shorter = f", lower max_model_len (serve --max-model-len) to at most {fits}" if fits else ""
    raise ValueError(
        f"the KV pool would get {blocks} blocks of {o.block_size} tokens ({block_bytes / (1 << 20):.2f} MiB each) "
        f"{where}; one {max_model_len}-token sequence needs {per_sequence} blocks{pinned}: raise "
        f"gpu_memory_utilization (serve --gpu-memory-utilization){shorter}, or free GPU memory"
    )


def check_pool_holds_pinned(num_blocks: int, pinned_blocks: int, o: EngineOptions, max_model_len: int) -> None:
    """Refuse, saying what to change, a pool that the pinned blocks would leave no room in for a request."""
    if num_blocks > pinned_blocks:
        return
    per_sequence = -(-max_model_len // o.block_size)
    if o.num_kv_blocks is None:
        fix = (f"free memory or raise kv_cache_memory_fraction (now {o.kv_cache_memory_fraction}), or set "
               f"num_kv_blocks (serve --num-kv-blocks) to {pinned_blocks + per_sequence}")
        pool = f"the pool sized from available memory has {num_blocks} blocks"
    else:
        fix = (f"raise num_kv_blocks (serve --num-kv-blocks) to at least {pinned_blocks + per_sequence} "
               f"({pinned_blocks} pinned plus {per_sequence} for one {max_model_len}-token sequence), or leave it "
               "unset to size the pool from memory")
        pool = f"num_kv_blocks is {num_blocks}"
    raise ValueError(f"snapshot prefixes and adapters pin {pinned_blocks} KV blocks and {pool}, which leaves no room "
                     f"for a request: {fix}")


def check_draft_compatible(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft proposes token ids the target verifies: both must share one vocabulary."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}; "
            "a draft model must use the target's tokenizer and vocabulary"
        )


def _check_prefix_shape(c: ModelConfig, kv: torch.Tensor, num_blocks: int, block_size: int, num_tokens: int) -> None:
    expected = (c.num_layers, 2, c.num_kv_heads, num_blocks, block_size, c.head_dim)
    if tuple(kv.shape) != expected or num_tokens < num_blocks * block_size:
        raise ValueError(f"prefix KV of shape {tuple(kv.shape)} for {num_tokens} tokens; expected {expected}")


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
