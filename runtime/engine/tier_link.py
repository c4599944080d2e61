"""The engine's use of the KV tier (runtime/engine/kv_tier.py): load a prompt's stored segments into the pool
before it is admitted, and store every whole segment a sequence computes.

A new request's chain of full blocks is looked up at once, from the first segment the pool does not already
cache; the request waits (others are admitted past it) until its lookup finishes or times out. What loaded is
written into free blocks registered in the prefix cache, left free as a finished sequence's are, so admission
finds it as an ordinary cache hit: the usage's cached_tokens count it, and nothing else in the engine changes.
A lookup that fails, times out or finds nothing costs a recompute, never a request.

After each step, a sequence whose computed blocks completed a segment has that segment copied out of the pool
(one gather, off the pool's memory so later steps cannot change it) and queued for the tier's writer. Segments
known to be in the tier (loaded, or written by this process) are not written again.

Requests through a LoRA adapter are left out for now: their blocks chain from a root drawn when the adapter is
registered (runtime/engine/lora.py), so another process could never find them, and an adapter's name alone would
not say which weights computed them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

import torch

from warmstart.runtime.engine.block_manager import BlockManager, block_hashes
from warmstart.runtime.engine.kv_tier import KVTier, Lookup
from warmstart.runtime.engine.model_runner import ModelRunner
from warmstart.runtime.engine.sequence import Sequence, Status

KNOWN_SEGMENTS = 65536  # last-block hashes of segments known to be in the tier, least recently seen dropped first


@dataclass
class _Waiting:
    seq: Sequence
    hashes: list[int]
    lookup: Lookup


class TierLink:
    def __init__(self, tier: KVTier, blocks: BlockManager, runner: ModelRunner, lookup_timeout_s: float = 2.0) -> None:
        self.tier, self.blocks, self.runner, self.lookup_timeout_s = tier, blocks, runner, lookup_timeout_s
        self.waiting: dict[str, _Waiting] = {}  # request id -> its lookup in flight
        self.saved: dict[str, tuple[Sequence, int]] = {}  # request id -> (it, its segments stored or known stored)
        self.known: OrderedDict[tuple[str, int], None] = OrderedDict()  # (adapter, last block hash)

    def on_add(self, seq: Sequence) -> None:
        """Start the lookup of a new sequence's stored segments."""
        if seq.params.prompt_logprobs is not None or seq.lora is not None:  # no logits for cached positions; below
            return
        bs, segment = self.blocks.block_size, self.tier.segment_blocks
        hashes = block_hashes(seq.token_ids[: (seq.num_tokens - 1) // bs * bs], bs, seq.hash_root)
        cached, _ = self.blocks.find_cached_prefix(seq.token_ids, seq.hash_root)
        lookup = self.tier.lookup(hashes, len(cached) // segment, seq.adapter)
        if lookup is not None:
            self.waiting[seq.request_id] = _Waiting(seq, hashes, lookup)

    def ready(self, seq: Sequence) -> bool:
        """Whether a waiting sequence may be admitted (its lookup, if any, is over)."""
        return seq.request_id not in self.waiting

    def poll(self, wait_s: float = 0.0) -> None:
        """Fill the pool with the lookups that finished (or give up on those past their time); with nothing else
        to run, wait up to ``wait_s`` for one."""
        if wait_s and self.waiting:
            wait([w.lookup.future for w in self.waiting.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for request_id, w in list(self.waiting.items()):
            if w.seq.status is Status.FINISHED:
                del self.waiting[request_id]
            elif w.lookup.future.done():
                del self.waiting[request_id]
                self._fill(w, w.lookup.future.result())
            elif now - w.lookup.started > self.lookup_timeout_s:
                del self.waiting[request_id]
                self.tier.stats.add(faults=1)  # slow: computed instead; the late result is dropped

    def _fill(self, w: _Waiting, segments: list[torch.Tensor]) -> None:
        bs, per = self.blocks.block_size, self.tier.segment_blocks
        first = w.lookup.first_segment * per
        asked = len(w.hashes) // per * per - first
        loaded = len(segments) * per
        self.tier.stats.add(miss_blocks=asked - loaded)
        if not segments:
            return
        for i in range(len(segments)):
            self._remember(w.seq.adapter, w.hashes[first + (i + 1) * per - 1])
        cached, _ = self.blocks.find_cached_prefix(w.seq.token_ids, w.seq.hash_root)
        start = max(len(cached), first)  # blocks the pool still lacks
        end = first + loaded
        if start >= end:
            return
        parent = w.hashes[start - 1] if start else w.seq.hash_root
        tokens = [tuple(w.seq.token_ids[b * bs : (b + 1) * bs]) for b in range(start, end)]
        blocks = self.blocks.adopt_cached(w.hashes[start:end], tokens, parent)
        if not blocks:
            return
        kv = torch.cat(segments, dim=3)[:, :, :, start - first :]  # [layers, 2, kv_heads, blocks, block_size, D]
        self.runner.fill_blocks(blocks, kv)
        self.tier.stats.add(hit_blocks=len(blocks))

    def after_step(self, seqs: list[Sequence]) -> None:
        """Queue the segments the step completed; forget finished sequences."""
        per = self.tier.segment_blocks
        for seq in seqs:
            if seq.lora is not None:
                continue
            done = self.saved.get(seq.request_id, (seq, 0))[1]
            whole = len(seq.block_hashes) // per
            for segment in range(done, whole):
                self._save(seq, segment)
            self.saved[seq.request_id] = (seq, max(done, whole))
        for request_id in [r for r, (seq, _) in self.saved.items() if seq.status is Status.FINISHED]:
            del self.saved[request_id]

    def _save(self, seq: Sequence, segment: int) -> None:
        per = self.tier.segment_blocks
        hashes = seq.block_hashes[segment * per : (segment + 1) * per]
        table = seq.block_table[segment * per : (segment + 1) * per]
        if (seq.adapter or "", hashes[-1]) in self.known or Sequence.NO_BLOCK in table:  # stored, or left the window
            return
        kv = self.runner.read_blocks(table).cpu()
        if self.tier.save(hashes, kv, seq.adapter):
            self._remember(seq.adapter, hashes[-1])

    def _remember(self, adapter: str | None, last_hash: int) -> None:
        self.known[(adapter or "", last_hash)] = None
        self.known.move_to_end((adapter or "", last_hash))
        while len(self.known) > KNOWN_SEGMENTS:
            self.known.popitem(last=False)
