"""BlockManager bookkeeping (allocation, ref counts, prefix cache, LRU, pins, sliding windows) and a
property test driving Scheduler + BlockManager without a model."""

from __future__ import annotations

import collections
from collections.abc import Sequence as Seq

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import warmstart.runtime.engine.block_manager as bm_module
from warmstart.runtime.engine.block_manager import NO_PARENT, BlockManager, block_hashes
from warmstart.runtime.engine.scheduler import ScheduledBatch, Scheduler
from warmstart.runtime.engine.sequence import Sequence, Status
from warmstart.runtime.sampling_params import SamplingParams

NO_BLOCK = Sequence.NO_BLOCK


def make_seq(tokens: Seq[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams())


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` and pretend its whole prompt was computed (as the engine does after a step)."""
    assert bm.start(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def hit_blocks(bm: BlockManager, tokens: Seq[int]) -> list[int]:
    return bm.find_cached_prefix(list(tokens))[0]


# -- allocation and reference counts ------------------------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 1)])
def test_constructor_rejects_empty_pool_or_block(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks, block_size)


def test_start_allocates_ceil_of_tokens_over_block_size() -> None:
    bm = BlockManager(8, 4)
    s = make_seq(range(10))
    assert bm.start(s, 10)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert all(bm.ref_counts[b] == 1 for b in s.block_table)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert not set(s.block_table) & set(bm.free)
    assert bm.blocks_needed(s, 0) == 0


def test_start_takes_blocks_only_for_the_chunk_asked_then_grow_adds_more() -> None:
    bm = BlockManager(8, 4)
    s = make_seq(range(10))
    assert bm.start(s, 5)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 5
    assert bm.blocks_needed(s, 5) == 1
    assert bm.grow(s, 5)
    assert len(s.block_table) == 3 and bm.num_used_blocks == 3
    assert bm.grow(s, 2) and len(s.block_table) == 3  # 7 + 5 = 12 tokens still fit in 3 blocks


def test_start_short_of_room_admits_the_chunk_that_fits() -> None:
    bm = BlockManager(3, 2)
    a = make_seq([1, 2, 3, 4, 5], "a")
    prefill(bm, a)
    bm.free_seq(a)  # a's two full blocks stay cached while free
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # hits 2 blocks, needs 3 more: pool has 1 spare
    assert bm.start(b, 9) == 2  # one spare block: two of the five remaining tokens
    assert b.num_computed_tokens == 4 and len(b.block_table) == 3
    assert bm.num_free_blocks == 0


def test_start_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(3, 2)
    a = make_seq([1, 2, 3, 4, 5], "a")
    prefill(bm, a)
    bm.free_seq(a)  # a's two full blocks stay cached while free
    holder = make_seq([50], "holder")
    assert bm.start(holder, 1) == 1  # takes the one spare block
    free_before = list(bm.free)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # hits 2 blocks, needs 3 more: no spare block
    assert bm.start(b, 9) == 0
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert list(bm.free) == free_before
    assert len(hit_blocks(bm, b.token_ids)) == 2  # the failed start did not evict its own hit


def test_grow_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(2, 4)
    s = make_seq(range(8))
    prefill(bm, s)
    table = list(s.block_table)
    assert bm.grow(s, 1) == 0
    assert s.block_table == table and bm.num_free_blocks == 0


def test_free_seq_releases_every_block_and_resets_the_sequence() -> None:
    bm = BlockManager(4, 4)
    s = make_seq(range(13))
    prefill(bm, s)
    bm.free_seq(s)
    assert bm.ref_counts == [0, 0, 0, 0] and bm.num_free_blocks == 4
    assert s.block_table == [] and s.block_hashes == [] and s.num_computed_tokens == 0


# -- prefix cache ---------------------------------------------------------------------------------------


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    bm = BlockManager(8, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    prefill(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 50, 51], "b")
    assert bm.start(b, 10)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.prefix_queries == 9 + 10 and bm.prefix_hits == 8
    bm.free_seq(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    bm.free_seq(b)
    assert bm.num_used_blocks == 0
    assert len(hit_blocks(bm, a.token_ids)) == 2  # unreferenced, still cached


@pytest.mark.parametrize(("prompt_len", "hit_tokens"), [(4, 0), (5, 4), (8, 4), (9, 8), (12, 8)])
def test_last_prompt_token_is_never_served_from_cache(prompt_len: int, hit_tokens: int) -> None:
    bm = BlockManager(8, 4)
    prefill(bm, make_seq(range(100, 112), "a"))  # 3 cached blocks
    s = make_seq(range(100, 100 + prompt_len), "b")
    assert bm.start(s, prompt_len)
    assert s.num_computed_tokens == hit_tokens < prompt_len


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    prefill(bm, make_seq(range(9), "a"))
    b = make_seq(range(9), "b")
    assert bm.start(b, 9)
    assert b.num_computed_tokens == 0 and bm.cached == {}


def test_hash_collision_with_different_tokens_does_not_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 12345)
    bm = BlockManager(8, 4)
    a = make_seq([1, 2, 3, 4, 5], "a")
    prefill(bm, a)
    assert bm.cached == {12345: a.block_table[0]}
    # Same tokens hit through the colliding hash, so lookups do go through the patched function ...
    assert hit_blocks(bm, [1, 2, 3, 4, 7]) == [a.block_table[0]]
    # ... and a different block of tokens with the same hash is not taken for it.
    b = make_seq([9, 9, 9, 9, 5], "b")
    assert hit_blocks(bm, b.token_ids) == []
    assert bm.start(b, 5)
    assert b.num_computed_tokens == 0 and a.block_table[0] not in b.block_table


def test_hash_collision_with_equal_block_after_different_prefix_does_not_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hash that forgets the parent collides exactly where the token check cannot see it.
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: hash(tuple(tokens)))
    bm = BlockManager(8, 2)
    a = make_seq([1, 1, 2, 2, 3, 3, 9], "a")  # blocks P Q X, X computed after P Q
    prefill(bm, a)
    # b is P X: its block X follows P only, so a's X block (positions 4-5, after P Q) holds other KV.
    assert hit_blocks(bm, [1, 1, 3, 3, 5]) == [a.block_table[0]]


# -- LRU eviction ----------------------------------------------------------------------------------------


def test_freed_cached_blocks_stay_findable_until_needed_and_tail_goes_first() -> None:
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4, 5], "a")
    prefill(bm, a)
    a0, a1, a2 = a.block_table
    bm.free_seq(a)
    never_used = ({0, 1, 2, 3} - {a0, a1, a2}).pop()
    assert list(bm.free) == [never_used, a2, a1, a0]  # tail first: the head is freed last
    assert bm.num_used_blocks == 0
    probe = [1, 2, 3, 4, 9]
    expected_hits = [[a0, a1], [a0, a1], [a0], []]
    holders = []
    for i, expected in enumerate(expected_hits):
        x = make_seq([100 + i], f"x{i}")
        assert bm.start(x, 1)
        holders.append(x)
        assert hit_blocks(bm, probe) == expected, f"after taking {i + 1} blocks"
    assert [x.block_table[0] for x in holders] == [never_used, a2, a1, a0]


def test_oldest_freed_prefix_is_evicted_first() -> None:
    bm = BlockManager(6, 2)
    a = make_seq([1, 2, 3, 4], "a")
    b = make_seq([5, 6, 7, 8], "b")
    prefill(bm, a)
    prefill(bm, b)
    b_blocks = list(b.block_table)
    bm.free_seq(a)
    bm.free_seq(b)
    for i in range(3):  # the two never-used blocks, then a's tail
        assert bm.start(make_seq([100 + i], f"x{i}"), 1)
    assert len(hit_blocks(bm, [1, 2, 3, 4, 0])) == 1
    assert bm.start(make_seq([200], "y"), 1)  # a's head
    assert hit_blocks(bm, [1, 2, 3, 4, 0]) == []
    assert hit_blocks(bm, [5, 6, 7, 8, 0]) == b_blocks


def test_a_cache_hit_makes_the_prefix_most_recently_used() -> None:
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4], "a")
    b = make_seq([5, 6, 7, 8], "b")
    prefill(bm, a)
    prefill(bm, b)
    bm.free_seq(a)
    bm.free_seq(b)  # a is older than b ...
    c = make_seq([1, 2, 3, 4, 9], "c")
    assert bm.start(c, 5) and c.num_computed_tokens == 4
    bm.free_seq(c)  # ... until c used a's blocks again
    for i in range(2):
        assert bm.start(make_seq([100 + i], f"x{i}"), 1)
    assert len(hit_blocks(bm, [1, 2, 3, 4, 0])) == 2
    assert hit_blocks(bm, [5, 6, 7, 8, 0]) == []


def test_second_copy_of_a_prefix_does_not_replace_the_cached_one() -> None:
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3, 4, 5], "a")
    b = make_seq([1, 2, 3, 4, 6], "b")
    assert bm.start(a, 5) and bm.start(b, 5)  # admitted together: neither hit
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.commit(s)
    assert sorted(bm.cached.values()) == sorted(a.block_table[:2])
    assert len(b.block_hashes) == 2  # b still knows its hashes (parents of later blocks)
    bm.free_seq(b)
    assert hit_blocks(bm, [1, 2, 3, 4, 0]) == a.block_table[:2]


def test_preempted_sequence_restart_does_not_count_as_new_prefix_query() -> None:
    bm = BlockManager(8, 2)
    s = make_seq([1, 2, 3, 4, 5])
    prefill(bm, s)
    queries, hits = bm.prefix_queries, bm.prefix_hits
    bm.free_seq(s)
    s.num_preemptions = 1
    assert bm.start(s, 5)
    assert s.num_computed_tokens == 4  # recomputed from its own cached prefix
    assert (bm.prefix_queries, bm.prefix_hits) == (queries, hits)
    assert s.num_cached_tokens == 0  # reports the first admission's hit, not the restart's


# -- pins -------------------------------------------------------------------------------------------------


def test_pinned_block_is_never_handed_out_or_freed() -> None:
    bm = BlockManager(4, 2)
    bm.pin(0)
    assert bm.ref_counts[0] == 1 and 0 not in bm.free and bm.num_used_blocks == 1
    big = make_seq(range(6), "big")
    assert bm.start(big, 6) and 0 not in big.block_table
    assert not bm.start(make_seq([7], "none-left"), 1)
    bm.free_seq(big)
    for round_ in range(3):  # churn the whole pool
        xs = [make_seq([10 * round_ + i], f"x{round_}{i}") for i in range(3)]
        for x in xs:
            assert bm.start(x, 1) and x.block_table != [0]
        for x in xs:
            bm.free_seq(x)
    assert bm.ref_counts[0] == 1 and 0 not in bm.free


def test_registered_pinned_snapshot_block_serves_hits_and_survives_release() -> None:
    bm = BlockManager(3, 2)
    (h,) = block_hashes([1, 2], 2, NO_PARENT)
    bm.register(2, h, (1, 2), NO_PARENT)
    bm.pin(2)
    s = make_seq([1, 2, 3])
    assert bm.start(s, 3)
    assert s.block_table[0] == 2 and s.num_computed_tokens == 2
    assert bm.ref_counts[2] == 2
    bm.free_seq(s)
    assert bm.ref_counts[2] == 1 and 2 not in bm.free
    for i in range(4):  # take every other block repeatedly: the pinned one is never evicted
        x = make_seq([50 + i, 60 + i, 70 + i, 80 + i], f"x{i}")
        assert bm.start(x, 4)
        bm.free_seq(x)
    assert hit_blocks(bm, [1, 2, 3]) == [2]


# -- sliding windows ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 4, 8, 9])
@pytest.mark.parametrize("computed", [0, 3, 8, 11, 12, 19, 20, 23, 24])
def test_free_outside_window_frees_exactly_the_invisible_blocks(window: int, computed: int) -> None:
    bs = 4
    bm = BlockManager(8, bs)
    s = make_seq(range(25))
    assert bm.start(s, 25)
    s.num_computed_tokens = computed
    table = list(s.block_table)
    bm.free_outside_window(s, window)
    # The next query sits at position `computed` and sees keys p with computed - window < p <= computed.
    invisible = [i for i in range(len(table)) if (i + 1) * bs - 1 <= computed - window]
    for i, block in enumerate(table):
        if i in invisible:
            assert s.block_table[i] == NO_BLOCK and bm.ref_counts[block] == 0 and block in bm.free
        else:
            assert s.block_table[i] == block and bm.ref_counts[block] == 1
    bm.free_outside_window(s, window)  # idempotent: no double release
    assert bm.num_free_blocks == 8 - len(table) + len(invisible)
    bm.free_seq(s)
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.ref_counts)


def test_blocks_freed_by_the_window_stay_cached() -> None:
    bm = BlockManager(8, 2)
    s = make_seq([1, 2, 3, 4, 5, 6, 7], "s")
    prefill(bm, s)
    table = list(s.block_table)
    bm.free_outside_window(s, 2)  # the next query (position 7) sees positions 6 and 7 only
    assert s.block_table == [NO_BLOCK, NO_BLOCK, NO_BLOCK, table[3]]
    assert all(b in bm.free for b in table[:3])
    assert hit_blocks(bm, [1, 2, 3, 4, 5, 6, 0]) == table[:3]


# -- Scheduler + BlockManager, driven without a model --------------------------------------------------------


class Sim:
    """Plays the engine's part: advances computed tokens, samples fake tokens, finishes and aborts.

    It also keeps a shadow KV cache (block -> offset -> the token prefix whose KV lives there) to check
    that every block a scheduled sequence relies on holds exactly its own tokens.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_seqs: int,
        caching: bool,
        window: int | None,
        pinned: int,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.pinned = list(range(pinned))
        for b in self.pinned:
            self.bm.pin(b)
        self.sched = Scheduler(self.bm, max_seqs, budget, window)
        self.budget = budget
        self.max_seqs = max_seqs
        self.window = window
        self.live: list[Sequence] = []
        self.target: dict[str, int] = {}
        self.done: list[Sequence] = []
        self.kv: dict[int, dict[int, tuple[int, ...]]] = collections.defaultdict(dict)
        self.ids = 0

    def fits(self, prompt_len: int, out_len: int) -> bool:
        return -(-(prompt_len + out_len) // self.bm.block_size) <= self.bm.num_blocks - len(self.pinned)

    def add(self, prompt: list[int], out_len: int) -> None:
        seq = make_seq(prompt, f"s{self.ids}")
        self.ids += 1
        self.target[seq.request_id] = out_len
        self.live.append(seq)
        self.sched.add(seq)

    def abort(self, index: int) -> None:
        seq = self.live.pop(index % len(self.live))
        self.sched.finish(seq, "abort")
        assert seq.block_table == [] and seq.is_finished
        self.done.append(seq)

    def step(self) -> ScheduledBatch:
        had_work = self.sched.has_work()
        batch = self.sched.schedule()
        bs = self.bm.block_size
        assert batch.total_tokens <= self.budget
        assert len(self.sched.running) <= self.max_seqs
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
        assert not had_work or batch.seqs, "work left but nothing scheduled"
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            c = seq.num_computed_tokens
            assert seq.status is Status.RUNNING and seq in self.sched.running
            assert 1 <= n <= seq.num_tokens - c
            assert len(seq.block_table) * bs >= c + n
            first_visible = 0 if self.window is None else max(0, c - self.window + 1)
            for pos in range(c):  # what the queries can attend to is exactly this sequence's KV
                block = seq.block_table[pos // bs]
                if pos >= first_visible:
                    assert block != NO_BLOCK, f"{seq.request_id}: visible position {pos} has no block"
                if block != NO_BLOCK:
                    assert self.kv[block].get(pos % bs) == tuple(seq.token_ids[: pos + 1]), (
                        f"{seq.request_id}: block {block} does not hold position {pos}"
                    )
            for pos in range(c, c + n):
                block = seq.block_table[pos // bs]
                assert block != NO_BLOCK and block not in self.pinned
                self.kv[block][pos % bs] = tuple(seq.token_ids[: pos + 1])
            seq.num_computed_tokens += n
            self.bm.commit(seq)
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(sum(seq.token_ids) % 3)  # a fake sample from a tiny vocabulary
                if seq.num_output_tokens >= self.target[seq.request_id]:
                    self.sched.finish(seq, "length")
                    self.live.remove(seq)
                    self.done.append(seq)
        return batch

    def check(self) -> None:
        bm = self.bm
        refs: collections.Counter[int] = collections.Counter(self.pinned)
        for seq in self.live:
            refs.update(b for b in seq.block_table if b != NO_BLOCK)
        assert [bm.ref_counts[b] for b in range(bm.num_blocks)] == [refs[b] for b in range(bm.num_blocks)]
        assert set(bm.free) == {b for b in range(bm.num_blocks) if refs[b] == 0}
        assert bm.num_free_blocks + len(+refs) == bm.num_blocks  # free and referenced partition the pool
        running, waiting = self.sched.running, list(self.sched.waiting)
        assert {id(s) for s in running} | {id(s) for s in waiting} == {id(s) for s in self.live}
        assert len(running) + len(waiting) == len(self.live)
        for seq in waiting:
            assert seq.status is Status.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in self.done:
            assert seq.is_finished and seq.block_table == []
        for h, b in bm.cached.items():
            assert bm.block_hash[b] == h

    def drain(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                break
            self.step()
            self.check()
        assert not self.sched.has_work(), "the scheduler did not finish its work"


def test_simulation_preempts_and_hits_prefix_cache() -> None:
    """The simulated load below does reach preemption and prefix hits, so the property test covers them."""
    sim = Sim(num_blocks=6, block_size=2, budget=4, max_seqs=4, caching=True, window=None, pinned=0)
    for i in range(4):
        sim.add([1, 2, 1, 2, i % 3], out_len=4)
    sim.drain()
    assert sim.sched.num_preemptions > 0
    assert sim.bm.prefix_hits > 0
    assert sorted(s.num_output_tokens for s in sim.done) == [4, 4, 4, 4]
    assert sim.bm.num_used_blocks == 0


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_scheduler_and_block_manager_keep_their_invariants(data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    pinned = data.draw(st.integers(0, 2), label="pinned")
    num_blocks = data.draw(st.integers(pinned + 2, pinned + 10), label="num_blocks")
    sim = Sim(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=data.draw(st.integers(1, 12), label="budget"),
        max_seqs=data.draw(st.integers(1, 4), label="max_seqs"),
        caching=data.draw(st.booleans(), label="caching"),
        window=data.draw(st.none() | st.integers(1, 8), label="window"),
        pinned=pinned,
    )
    base = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    ops = data.draw(st.lists(st.sampled_from(["add", "step", "step", "abort"]), max_size=40), label="ops")
    for op in ops:
        if op == "add":
            shared = data.draw(st.integers(0, len(base)))
            tail = data.draw(st.lists(st.integers(0, 2), max_size=6))
            prompt = (base[:shared] + tail) or [0]
            out_len = data.draw(st.integers(1, 8))
            if sim.fits(len(prompt), out_len):  # the engine rejects what can never fit
                sim.add(prompt, out_len)
        elif op == "abort" and sim.live:
            sim.abort(data.draw(st.integers(0, 100)))
        elif op == "step":
            sim.step()
        sim.check()
    sim.drain()
    assert sim.bm.num_free_blocks == num_blocks - pinned
    assert all(sim.bm.ref_counts[b] == (1 if b < pinned else 0) for b in range(num_blocks))
    for seq in sim.done:
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == sim.target[seq.request_id]
