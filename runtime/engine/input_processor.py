"""Input processing: a prompt and its sampling parameters checked, tokenized and turned into a Sequence, with the
adapter it names resolved (a compiled soft prompt's virtual tokens lead its prompt; a LoRA adapter salts its
block hashes) and the request refused, naming the field, when it could never be served."""

from __future__ import annotations

import itertools
from collections.abc import Container

import torch

from warmstart.runtime.engine.adapters import AdapterSelector, VirtualPrefix
from warmstart.runtime.engine.admission import Admission
from warmstart.runtime.engine.block_manager import NO_PARENT, salted_root
from warmstart.runtime.engine.lora import LoraManager
from warmstart.runtime.engine.sequence import Sequence
from warmstart.runtime.engine.structured import GrammarCompiler, compiler_for
from warmstart.runtime.sampling_params import SamplingParams
from warmstart.runtime.tokenizer import Tokenizer

Prompt = str | list[int]


class InputProcessor:
    def __init__(
        self,
        vocab_size: int,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        eos_token_ids: set[int],
        adapters: dict[str, VirtualPrefix],
        loras: LoraManager,
        admission: Admission,
        live_request_ids: Container[str],
        embed: torch.Tensor,
    ) -> None:
        """``eos_token_ids`` and ``adapters`` are the engine's own, read as they grow; ``live_request_ids``
        the ids now in use; ``embed`` the embedding table the adapter selector pools a query's tokens in."""
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.adapters = adapters
        self.loras = loras
        self.admission = admission
        self.live_request_ids = live_request_ids
        self.embed = embed
        self.adapter_selector: AdapterSelector | None = None
        self._ids = itertools.count()

    def make_sequence(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, adapter: str | None = None
    ) -> Sequence:
        """A request as the scheduler takes it; raises ValueError naming the bad field."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.live_request_ids or f"{request_id}#1" in self.live_request_ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.prompt_token_ids(prompt)
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
        self.admission.check_fits_pool(token_ids, params.max_tokens, hash_root)
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

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (text tokenized), each checked to be in the vocabulary."""
        token_ids = self.tokenize(prompt)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            bad = next(t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        return token_ids

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

    def _check_processing_ids(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
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
        return compiler_for(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))

    def kv_room(self, token_ids: list[int], adapter: str | None = None) -> int:
        """How many tokens may follow a prompt in the KV pool with every other request gone (see
        Admission.kv_room); ``adapter`` as for LLMEngine.add_request (its virtual tokens lead the prompt)."""
        prefix = self.resolve_adapter(adapter, token_ids)
        root = self.loras.hash_root(adapter) if adapter is not None and adapter in self.loras else NO_PARENT
        return self.admission.kv_room(token_ids if prefix is None else prefix.token_ids + token_ids, root)

    def resolve_adapter(self, name: str | None, token_ids: list[int]) -> VirtualPrefix | None:
        """The compiled adapter a request names ("auto": the selector's choice for its tokens), or None for none
        or a LoRA adapter (see LLMEngine.add_lora)."""
        if name is None or name in self.loras:
            return None
        if name == "auto":
            name = self.select_adapter(token_ids)
        if name not in self.adapters:
            known = ", ".join(sorted([*self.adapters, *self.loras.names()])) or "none"
            raise ValueError(f"unknown adapter {str(name)[:100]!r}; this engine's adapters: {known}")
        return self.adapters[name]

    def select_adapter(self, token_ids: list[int]) -> str:
        """The selector's adapter for a query's tokens (see runtime.engine.adapters.AdapterSelector)."""
        if self.adapter_selector is None:
            raise ValueError("adapter 'auto' needs a selector; build the snapshot with --adapter-examples")
        return self.adapter_selector.select(token_ids, self.embed)
