"""The paged KV pool's bookkeeping: free list, reference counts and the prefix cache of full blocks.

Free blocks live in one LRU-ordered dict. A block whose reference count drops to zero keeps its hash and
stays findable by the prefix cache until it is taken for new tokens, oldest first; that is how cached
prefixes survive without costing the pool anything.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

import xxhash

from warmstart.runtime.engine.sequence import Sequence

NO_PARENT = 0


def hash_block(parent_hash: int, token_ids: Seq[int]) -> int:
    """Chained hash of one full block: covers every token before it through the parent's hash."""
    return xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes())


def salted_root(root: int, salt: str | None) -> int:
    """Where a request's chain starts: ``root`` (none, or a LoRA adapter's), or for a cache salt one derived from
    both, so that no block hash of the chain equals one of another salt's, or of no salt's."""
    if salt is None:
        return root
    return xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + b"\0cache_salt\0" + salt.encode("utf-8", "replace"))


def block_hashes(token_ids: Seq[int], block_size: int, parent_hash: int = NO_PARENT) -> list[int]:
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_parent: list[int] = [NO_PARENT] * num_blocks  # hash of the block before it in its chain
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.pinned: set[int] = set()  # held for good (snapshot prefixes, adapters): never free, never evicted
        self.cached: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) blocks to copy before the next step
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever hold (with every other request gone): the pool less the pinned ones."""
        return self.num_blocks - len(self.pinned)

    def pinned_prefix_blocks(self, token_ids: Seq[int], root: int = NO_PARENT) -> int:
        """How many leading blocks of ``token_ids`` a request is always served from pinned blocks (which are
        never evicted, so the hit is certain at every admission): blocks it never needs from the free pool."""
        blocks, _ = self.find_cached_prefix(token_ids, root)
        return next((i for i, block in enumerate(blocks) if block not in self.pinned), len(blocks))

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    # -- prefix cache ---------------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Seq[int], root: int = NO_PARENT) -> tuple[list[int], list[int]]:
        """Blocks holding the longest cached prefix of ``token_ids`` and their hashes, the chain starting from
        ``root`` (a LoRA adapter's, whose KV is its own: Sequence.hash_root).

        The last token is never served from the cache: its logits are needed to sample. With prefix caching
        off, only blocks registered from outside (pinned snapshot prefixes and adapters) are ever found.
        """
        max_blocks = (len(token_ids) - 1) // self.block_size
        blocks: list[int] = []
        hashes = block_hashes(token_ids[: max_blocks * self.block_size], self.block_size, root)
        parent = root
        for i, h in enumerate(hashes):
            block = self.cached.get(h)
            start = i * self.block_size
            # A hash collision cannot serve wrong KV: the tokens and the chain link are checked too.
            if (
                block is None
                or self.block_parent[block] != parent
                or self.block_tokens[block] != tuple(token_ids[start : start + self.block_size])
            ):
                break
            blocks.append(block)
            parent = h
        return blocks, hashes[: len(blocks)]

    def start(self, seq: Sequence, max_new_tokens: int) -> int:
        """Admit a waiting sequence: take its cached prefix, then blocks for up to ``max_new_tokens`` more.

        Returns how many tokens past the cached prefix it may compute now (fewer when the pool is short),
        or 0, changing nothing, when the pool cannot take even one.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        hit_blocks, hit_hashes = self.find_cached_prefix(seq.token_ids, seq.hash_root)
        if seq.params.prompt_logprobs is not None:  # a cached position has no logits: only adapters' blocks
            keep = seq.num_virtual_tokens // self.block_size
            hit_blocks, hit_hashes = hit_blocks[:keep], hit_hashes[:keep]
        num_hit_tokens = len(hit_blocks) * self.block_size
        # An adapter's partial tail block is copied, not shared: its slots are part of the sequence's own block.
        tail = seq.num_virtual_tokens - num_hit_tokens if seq.virtual_tail_block is not None else 0
        assert 0 <= tail < self.block_size or num_hit_tokens >= seq.num_virtual_tokens, "adapter blocks not pinned"
        tail = max(0, tail)
        reusable_free = sum(1 for b in hit_blocks if self.ref_counts[b] == 0)
        room = (len(self.free) - reusable_free) * self.block_size - tail
        n = min(max_new_tokens, seq.num_tokens - num_hit_tokens - tail, room)
        if n <= 0:
            return 0
        for block in hit_blocks:
            self._take(block)
        seq.block_table = hit_blocks
        seq.block_hashes = hit_hashes
        seq.num_computed_tokens = num_hit_tokens + tail
        self._append_blocks(seq, self.blocks_needed(seq, n))
        if tail:
            assert seq.virtual_tail_block is not None
            self.pending_copies.append((seq.virtual_tail_block, seq.block_table[num_hit_tokens // self.block_size]))
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_hit_tokens + tail
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += num_hit_tokens + tail
        return n

    def grow(self, seq: Sequence, max_new_tokens: int) -> int:
        """Make room for up to ``max_new_tokens`` more tokens of a running sequence; returns how many fit."""
        room = len(seq.block_table) * self.block_size - seq.num_computed_tokens + len(self.free) * self.block_size
        n = min(max_new_tokens, room)
        self._append_blocks(seq, self.blocks_needed(seq, n))
        return n

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hash_block(parent, tokens)
            seq.block_hashes.append(block_hash)
            block = seq.block_table[i]
            if self.enable_prefix_caching and block != Sequence.NO_BLOCK and block_hash not in self.cached:
                self.register(block, block_hash, tokens, parent)
            parent = block_hash

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give ``child`` the KV of ``parent``'s computed tokens: its full blocks shared (one more reference
        each), its partial last block copied into a block of the child's own before the next step (both will
        write their next tokens there). False, changing nothing, when no block is free for the copy."""
        full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and not self.free:
            return False
        shared = parent.block_table[:full]
        for block in shared:
            if block != Sequence.NO_BLOCK:
                self._take(block)
        child.block_table = list(shared)
        if partial:
            child.block_table += self.take_free(1)
            self.pending_copies.append((parent.block_table[full], child.block_table[full]))
        child.block_hashes = parent.block_hashes[:full]
        child.num_computed_tokens = parent.num_computed_tokens
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Release every block; tail first, so a shared head stays cached longest."""
        for block in reversed(seq.block_table):
            if block != Sequence.NO_BLOCK:
                self._release(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.draft_computed = 0

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past a sequence's computed tokens (the slots of rejected speculative tokens).
        They hold nothing cacheable, so they go to the front of the free list, to be taken first."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self._release(block)
            if self.ref_counts[block] == 0 and self.block_hash[block] is None:
                self.free.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def free_outside_window(self, seq: Sequence, window: int) -> None:
        """Let go of blocks no future query can see: all their positions are <= next_position - window."""
        first_visible = seq.num_computed_tokens - window + 1
        for i in range(max(0, first_visible) // self.block_size):
            block = seq.block_table[i]
            if block != Sequence.NO_BLOCK:
                self._release(block)
                seq.block_table[i] = Sequence.NO_BLOCK

    def pin(self, block: int) -> None:
        """Hold a block for good (snapshot prefixes): it is never freed or evicted."""
        self._take(block)
        self.pinned.add(block)

    def take_pinned(self, count: int) -> list[int]:
        """Take ``count`` free blocks for good (KV filled from outside: snapshot prefixes, adapters)."""
        blocks = self.take_free(count)
        self.pinned.update(blocks)
        return blocks

    def take_free(self, count: int) -> list[int]:
        """Take ``count`` free blocks (oldest first, evicting what they cached) with one reference each."""
        if count > len(self.free):
            raise ValueError(f"{count} blocks asked for, {len(self.free)} free")
        taken = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            taken.append(block)
        return taken

    def register(self, block: int, block_hash: int, token_ids: tuple[int, ...], parent_hash: int) -> None:
        """Make a full block findable by the prefix cache (also for KV filled from outside, a snapshot)."""
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        self.block_tokens[block] = token_ids
        self.block_parent[block] = parent_hash

    def adopt_cached(self, hashes: Seq[int], token_chunks: Seq[tuple[int, ...]], parent_hash: int) -> list[int]:
        """Free blocks made findable by the prefix cache under a chain computed elsewhere (the KV tier), left free
        as a finished sequence's blocks are; the caller fills their KV before the next step. [] when the pool has
        too few free blocks."""
        if len(hashes) > len(self.free):
            return []
        blocks = self.take_free(len(hashes))
        for block, block_hash, tokens in zip(blocks, hashes, token_chunks, strict=True):
            self.register(block, block_hash, tokens, parent_hash)
            parent_hash = block_hash
        for block in blocks:
            self._release(block)
        return blocks

    # -- internals ------------------------------------------------------------------------------------

    def _append_blocks(self, seq: Sequence, count: int) -> None:
        seq.block_table.extend(self.take_free(count))

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released more often than taken"
        if self.ref_counts[block] == 0:
            self.free[block] = None

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None
            self.block_parent[block] = NO_PARENT
