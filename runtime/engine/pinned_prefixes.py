"""Pinned KV: a snapshot's precomputed prefixes and compiled adapters, written into pool blocks that are never
evicted and registered in the prefix cache under their chained hashes, so that a request starting with them is
served them as a cache hit. Loaded once at cold start, before the first request."""

from __future__ import annotations

import torch

from warmstart.runtime.engine.adapters import VirtualPrefix, virtual_token_ids
from warmstart.runtime.engine.block_manager import NO_PARENT, BlockManager, block_hashes
from warmstart.runtime.engine.model_runner import ModelRunner
from warmstart.runtime.engine.sequence import Sequence
from warmstart.runtime.engine.speculative import DraftProposer
from warmstart.runtime.models.config import ModelConfig
from warmstart.runtime.sampling_params import SamplingParams


class PinnedPrefixes:
    def __init__(
        self,
        config: ModelConfig,
        blocks: BlockManager,
        runner: ModelRunner,
        adapters: dict[str, VirtualPrefix],
        max_model_len: int,
        enable_prefix_caching: bool,
        draft_config: ModelConfig | None = None,
        draft_proposer: DraftProposer | None = None,
    ) -> None:
        """``adapters``: the engine's registry of compiled adapters, which load_adapter adds to; ``draft_config``:
        the draft model's, when the engine has one; ``draft_proposer``, when it drafts with it: its pool gets a
        prefix's draft KV beside the target's."""
        self.config = config
        self.blocks = blocks
        self.runner = runner
        self.adapters = adapters
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.draft_config = draft_config
        self.draft_proposer = draft_proposer

    def load_prefix(
        self, token_ids: list[int], hashes: list[int], kv: torch.Tensor, draft_kv: torch.Tensor | None = None
    ) -> None:
        """Put a precomputed prefix's blocks (see LLMEngine.prefix_kv) into the pool, pinned and findable by the
        prefix cache. ``draft_kv``, the draft model's prefix_kv for the same tokens, goes into the draft's pool for
        the same blocks."""
        bs = self.blocks.block_size
        check_prefix_shape(self.config, kv, len(hashes), bs, len(token_ids))
        if draft_kv is not None and self.draft_config is not None:
            check_prefix_shape(self.draft_config, draft_kv, len(hashes), bs, len(token_ids))
        if hashes != block_hashes(token_ids, bs)[: len(hashes)]:
            raise ValueError("prefix block hashes do not match its token ids")
        if not self.enable_prefix_caching or not hashes:
            return
        blocks = self._take_pinned(len(hashes), f"a prefix of {len(token_ids)} tokens")
        self.runner.fill_blocks(blocks, kv)
        if draft_kv is not None and self.draft_proposer is not None:
            self.draft_proposer.loaded(blocks, hashes, draft_kv)
        self._register_chain(blocks, hashes, token_ids)

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
            per_sequence = -(-self.max_model_len // self.blocks.block_size)
            raise ValueError(
                f"{what} needs {count} KV blocks pinned, but only {free} of the pool's {self.blocks.num_blocks} are "
                f"free ({pinned} already pinned): raise num_kv_blocks (serve --num-kv-blocks) to at least "
                f"{pinned + count + per_sequence}, or leave it unset to size the pool from memory"
            )
        return self.blocks.take_pinned(count)


def check_prefix_shape(c: ModelConfig, kv: torch.Tensor, num_blocks: int, block_size: int, num_tokens: int) -> None:
    expected = (c.num_layers, 2, c.num_kv_heads, num_blocks, block_size, c.head_dim)
    if tuple(kv.shape) != expected or num_tokens < num_blocks * block_size:
        raise ValueError(f"prefix KV of shape {tuple(kv.shape)} for {num_tokens} tokens; expected {expected}")
