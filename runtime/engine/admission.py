"""Admission: whether a request can ever fit the KV pool (checked when it is added), and whether a waiting
sequence may start now (asked by the scheduler): its KV tier lookup is over and its LoRA adapter has a slot."""

from __future__ import annotations

from warmstart.runtime.engine.block_manager import NO_PARENT, BlockManager
from warmstart.runtime.engine.lora import LoraLoadError, LoraManager
from warmstart.runtime.engine.sequence import Sequence
from warmstart.runtime.engine.tier_link import TierLink


class Admission:
    def __init__(self, blocks: BlockManager, loras: LoraManager, uniform_window: int | None,
                 max_model_len: int) -> None:  # fmt: skip
        self.blocks = blocks
        self.loras = loras
        self.uniform_window = uniform_window
        self.max_model_len = max_model_len
        self.tier_link: TierLink | None = None
        self.lora_load_failed: list[Sequence] = []  # waiting sequences whose adapter failed to load: aborted next

    def admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether a waiting sequence may start: its KV tier lookup is over, and its LoRA adapter has a slot."""
        if self.tier_link is not None and not self.tier_link.ready(seq):
            return False
        if seq.lora is None:
            return True
        try:
            return self.loras.acquire(seq.lora, {s.lora for s in running if s.lora is not None})
        except LoraLoadError:  # not the engine's failure: the request ends (LLMEngine.step aborts it)
            self.lora_load_failed.append(seq)
            return False

    def take_failed(self) -> list[Sequence]:
        """The sequences whose adapter failed to load since the last call (engine.loras.stats says why)."""
        failed, self.lora_load_failed = self.lora_load_failed, []
        return failed

    def kv_room(self, token_ids: list[int], root: int = NO_PARENT) -> int:
        """How many tokens may follow a prompt (virtual tokens included) in the KV pool with every other request
        gone: admission's bound on max_tokens, before the context's. Safe to call from another thread than the
        step loop's: what it reads of the pool, the pinned blocks, never changes once they are loaded."""
        bs, usable = self.blocks.block_size, self.blocks.num_usable_blocks
        window = self.uniform_window
        if window and -(-(window + 1) // bs) + 1 <= usable:
            return self.max_model_len  # a sequence never holds more than the window's blocks plus the one written
        # The blocks of a pinned prefix the prompt starts with are shared: never taken from the free pool.
        return (usable + self.blocks.pinned_prefix_blocks(token_ids, root)) * bs - len(token_ids)

    def check_fits_pool(self, token_ids: list[int], max_tokens: int, root: int = NO_PARENT) -> None:
        """Refuse a request that could never be scheduled: one needing more blocks than can ever be free for
        it, even with every other request gone. Accepted, it would wait forever and hold up the queue."""
        room = self.kv_room(token_ids, root)
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
