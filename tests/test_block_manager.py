"""Unit tests of the paged block allocator (prefix cache included) and of the token-budget scheduler."""

from __future__ import annotations

import itertools
import random

import pytest

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.scheduler import Scheduler, SchedulerOutput
from leapdecode.engine.sequence import Sequence, SequenceStatus
from leapdecode.sampling_params import SamplingParams

_bases = itertools.count(1000, 1000)


def seq(tokens: list[int] | int, rid: str = "r", max_tokens: int = 16) -> Sequence:
    """A sequence of the given tokens, or of ``tokens`` distinct tokens no other sequence shares."""
    if isinstance(tokens, int):
        base = next(_bases)
        tokens = list(range(base, base + tokens))
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens))


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Mark every token of ``s`` as computed (allocating room) and register its full blocks."""
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    return s


def check_accounting(bm: BlockManager) -> None:
    """Free pool, cached pool and ref counts agree with each other."""
    free, cached = set(bm.free_ids), set(bm.cached_free)
    assert not free & cached
    for b in bm.blocks:
        in_pool = b.block_id in free or b.block_id in cached
        assert in_pool == (b.ref_count == 0), b
        if b.block_id in free:
            assert b.block_hash is None
        if b.block_id in cached:
            assert bm.hash_to_block[b.block_hash] == b.block_id  # type: ignore[index]
    assert bm.num_free_blocks == len(free) + len(cached)


# ------------------------------------------------------------------------------------------ block manager


def test_allocate_and_free() -> None:
    bm = BlockManager(8, 4)
    s = seq(10)
    assert bm.blocks_needed(10) == 3 and bm.blocks_needed(12) == 3 and bm.blocks_needed(13) == 4
    assert bm.can_allocate(s, 32) and not bm.can_allocate(s, 33)
    bm.allocate(s, 10)
    assert s.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0, 0, 0, 0, 0]
    bm.allocate(s, 12)  # still fits in 3 blocks: nothing new
    assert s.block_table == [0, 1, 2]
    bm.allocate(s, 13)
    assert s.block_table == [0, 1, 2, 3]
    assert bm.slot(s, 0) == 0 and bm.slot(s, 5) == 5 and bm.slot(s, 12) == 12
    check_accounting(bm)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)
    check_accounting(bm)


def test_out_of_blocks_and_double_free() -> None:
    bm = BlockManager(2, 4)
    s = seq(8)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(s, 9)
    assert s.block_table == [] and bm.num_free_blocks == 2  # a failed allocation takes nothing
    bm.allocate(s, 8)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(AssertionError, match="double free"):
        bm.free(s)
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_contiguous_first_allocation() -> None:
    bm = BlockManager(12, 4)
    a, b = seq(4, "a"), seq(4, "b")
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    assert (a.block_table, b.block_table) == ([0], [1])
    bm.allocate(a, 8)  # block 1 is taken: the next free one
    assert a.block_table == [0, 2]
    bm.allocate(b, 12)  # 2 is taken, so 3, then 4 right after it
    assert b.block_table == [1, 3, 4]
    bm.free(a)  # freed blocks go to the head of the free list (most recent first): 0, 2, 5..11
    c = seq(4, "c")
    bm.allocate(c, 4)
    assert c.block_table == [0]  # the most recently freed block is reused first
    bm.allocate(c, 16)  # 1 is b's: head 2, then 3 is b's: head 5, then 6 right after it
    assert c.block_table == [0, 2, 5, 6]
    d = seq(4, "d")
    bm.allocate(d, 16)
    assert d.block_table == [7, 8, 9, 10]
    bm.free(d)
    e = seq(4, "e")
    bm.allocate(e, 12)
    assert e.block_table == [7, 8, 9]  # a freed run is handed out again as a run
    check_accounting(bm)


def test_ref_counts_with_shared_prefix() -> None:
    bm = BlockManager(16, 4)
    a = computed(bm, seq(list(range(10)), "a"))
    assert len(a.block_hashes) == 2  # two full blocks; the partial third is not hashed
    b = seq(list(range(10)) + [99], "b")
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1]
    assert bm.num_free_blocks == 14  # a's private third block is free; the shared two are held by b
    bm.free(b)
    assert bm.num_free_blocks == 16 and len(bm.cached_free) == 2
    check_accounting(bm)


def test_prefix_hash_chain() -> None:
    bm = BlockManager(32, 4)
    computed(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], "a"))
    assert bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0], "b")) == 12
    assert bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 0], "c")) == 4
    # the second block's tokens alone do not match: its hash depends on the first block
    assert bm.match_prefix(seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "d")) == 0
    # at least one token is left to compute, even when the whole prompt is cached
    e = seq([1, 2, 3, 4, 5, 6, 7, 8], "e")
    assert bm.match_prefix(e) == 4 and len(e.block_table) == 1
    # matched blocks bring their hashes, so the chain continues from them
    assert e.block_hashes == [bm.blocks[e.block_table[0]].block_hash]


def test_prefix_match_checks_tokens_not_just_hashes(monkeypatch) -> None:
    bm = BlockManager(16, 4)
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda parent, tokens: 42))  # all collide
    computed(bm, seq([1, 2, 3, 4, 5], "a"))
    other = seq([9, 9, 9, 9, 5], "b")
    assert bm.match_prefix(other) == 0 and other.block_table == []
    same = seq([1, 2, 3, 4, 7], "c")
    assert bm.match_prefix(same) == 4


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = computed(bm, seq(list(range(12)), "a"))
    assert a.block_hashes == [] and bm.hash_to_block == {}
    bm.free(a)
    assert bm.match_prefix(seq(list(range(12)), "b")) == 0
    assert len(bm.free_ids) == 16 and not bm.cached_free


def test_lru_reuse_of_cached_free_blocks() -> None:
    bm = BlockManager(6, 4)
    a = computed(bm, seq([1] * 4 + [2] * 4 + [3], "a"))  # blocks 0, 1 hashed; 2 partial
    b = computed(bm, seq([7] * 4 + [8] * 4 + [9], "b"))  # blocks 3, 4 hashed; 5 partial
    bm.free(a)  # cached in LRU order 1, 0 (freed last block first); 2 goes to the free list
    bm.free(b)  # then 4, 3; 5 free
    assert list(bm.cached_free) == [1, 0, 4, 3]
    assert bm.num_free_blocks == 6
    check_accounting(bm)
    # a cache hit pulls a block out of the LRU list
    a2 = seq([1] * 4 + [2] * 4 + [3], "a2")
    assert bm.match_prefix(a2) == 8
    assert list(bm.cached_free) == [4, 3]
    bm.free(a2)
    assert list(bm.cached_free) == [4, 3, 1, 0]  # most recently freed at the end
    # new blocks come from the free list first, then evict the least recently freed cached block
    c = seq([5] * 13, "c")
    bm.allocate(c, 13)  # 4 blocks: 2, 5 (free list), then evict 4, 3
    assert c.block_table == [5, 2, 4, 3]  # free blocks (most recently freed first), then LRU evictions
    assert list(bm.cached_free) == [1, 0]
    assert bm.match_prefix(seq([7] * 4 + [8] * 4 + [9], "b2")) == 0  # b's blocks were evicted
    a3 = seq([1] * 4 + [2] * 4 + [3], "a3")
    assert bm.match_prefix(a3) == 8  # a's survive
    assert all(bm.blocks[i].block_hash is None for i in (3, 4))
    bm.free(a3)
    bm.free(c)
    check_accounting(bm)


def test_duplicate_block_stays_private() -> None:
    """Two sequences computing the same block separately: only the first is registered."""
    bm = BlockManager(8, 4)
    a = computed(bm, seq([1, 2, 3, 4, 5], "a"))
    b = seq([1, 2, 3, 4, 6], "b")
    bm.allocate(b, 5)  # no match_prefix: computes its own copy
    b.num_computed_tokens = 5
    bm.commit_full_blocks(b)
    assert b.block_hashes == a.block_hashes  # same chain
    assert bm.hash_to_block[a.block_hashes[0]] == a.block_table[0]
    assert bm.blocks[b.block_table[0]].block_hash is None
    bm.free(b)
    assert not bm.cached_free  # b's copy is not cached
    first = a.block_table[0]
    bm.free(a)
    assert list(bm.cached_free) == [first]
    check_accounting(bm)


def test_trim_releases_blocks_and_hashes() -> None:
    bm = BlockManager(8, 4)
    s = seq(6)
    bm.allocate(s, 15)
    assert len(s.block_table) == 4
    s.num_computed_tokens = 6
    bm.commit_full_blocks(s)
    assert len(s.block_hashes) == 1
    bm.trim(s, 6)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    bm.trim(s, 3)
    assert len(s.block_table) == 1 and s.block_hashes == [s.block_hashes[0]]
    bm.trim(s, 0)
    assert s.block_table == [] and s.block_hashes == []
    assert bm.num_free_blocks == 8
    check_accounting(bm)


def test_reset_prefix_cache() -> None:
    bm = BlockManager(8, 4)
    a = computed(bm, seq(list(range(9)), "a"))
    b = computed(bm, seq(list(range(50, 59)), "b"))
    bm.free(a)
    bm.reset_prefix_cache()
    assert not bm.cached_free and bm.num_free_blocks == 5
    assert bm.match_prefix(seq(list(range(9)), "a2")) == 0
    c = seq(list(range(50, 59)), "c")
    assert bm.match_prefix(c) == 8  # blocks in use keep their hashes
    bm.free(b)
    bm.free(c)
    check_accounting(bm)


def test_random_workload_keeps_accounting() -> None:
    rng = random.Random(0)
    bm = BlockManager(40, 4)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for i in range(300):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 6):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            toks = rng.choice(prefixes)[: rng.randrange(1, 13)] + [
                rng.randrange(50) for _ in range(rng.randrange(1, 9))
            ]
            s = seq(toks, f"s{i}")
            got = bm.match_prefix(s)
            assert got % 4 == 0 and got < len(toks)
            assert s.token_ids[:got] == list(sum((bm.blocks[b].token_ids for b in s.block_table), ()))
            s.num_computed_tokens = got
            computed(bm, s)
            live.append(s)
        check_accounting(bm)
        assert sum(b.ref_count for b in bm.blocks) == sum(len(s.block_table) for s in live)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == 40


# ------------------------------------------------------------------------------------------------ scheduler


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget)


def apply(sched: Scheduler, out: SchedulerOutput, next_token: int = 7) -> list[Sequence]:
    """What the engine does after a forward: advance, sample one token per finished prefill, finish at
    ``max_tokens``. Returns the sequences that finished."""
    done = []
    for s in out.scheduled:
        q = s.seq
        q.num_computed_tokens += s.num_new_tokens
        assert q.num_computed_tokens <= q.num_tokens
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(next_token)
            if q.num_output_tokens >= q.params.max_tokens:
                done.append(q)
        sched.bm.commit_full_blocks(q)
    for q in done:
        sched.finish(q)
    return done


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def run_to_end(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.scheduled, "nothing scheduled while requests are unfinished"
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        apply(sched, out)
        outs.append(out)
        assert len(outs) < max_steps
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
    return outs


def test_fcfs_and_token_budget() -> None:
    sched = make_scheduler(budget=15)
    a, b, c = seq(10, "a", 3), seq(10, "b", 3), seq(10, "c", 3)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("a", 10), ("b", 5)]  # oldest first; b's prompt is cut to the budget
    assert out.num_tokens == 15 and [s.status for s in (a, b, c)] == [SequenceStatus.RUNNING] * 2 + [
        SequenceStatus.WAITING
    ]
    apply(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 5), ("c", 9)]  # running first (a decodes, b continues), then c
    apply(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1), ("c", 1)]
    apply(sched, out)
    assert a.is_finished and a.block_table == []
    outs = run_to_end(sched)
    assert all(o.num_tokens <= 15 for o in outs)
    assert [s.num_output_tokens for s in (a, b, c)] == [3, 3, 3]


def test_chunked_prefill_of_a_long_prompt() -> None:
    sched = make_scheduler(budget=16)
    s = seq(50, "long", 2)
    sched.add(s)
    chunks = []
    while not s.is_finished:
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        assert len(s.block_table) * 4 >= s.num_computed_tokens + chunks[-1]  # room for the chunk
        apply(sched, out)
    assert chunks == [16, 16, 16, 2, 1]


def test_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=100)
    seqs = [seq(5, f"s{i}", 2) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("s0", 5), ("s1", 5)]
    run_to_end(sched)
    assert all(s.num_output_tokens == 2 for s in seqs)


def test_budget_respected_under_random_load() -> None:
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=48, budget=24, max_num_seqs=5)
    seqs = []
    for i in range(20):
        s = seq([rng.randrange(1000) for _ in range(rng.randrange(1, 60))], f"s{i}", rng.randrange(1, 12))
        seqs.append(s)
        sched.add(s)
    outs = run_to_end(sched)
    assert all(o.num_tokens <= 24 for o in outs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert all(s.num_tokens - s.num_output_tokens == s.num_prompt_tokens for s in seqs)


def test_long_prompt_is_not_starved_by_short_ones() -> None:
    """A long prompt that arrives while short requests keep coming is served before every later arrival."""
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=4, budget=16)
    first_step: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    long = seq(120, "long", 4)
    n = 0
    for step in range(200):
        if step < 80:  # a short request every step
            sched.add(seq([step % 50 + 1] * 6, f"short{n}", 3))
            n += 1
        if step == 3:
            sched.add(long)
        out = sched.schedule()
        for s in out.scheduled:
            first_step.setdefault(s.seq.request_id, step)
        for s in apply(sched, out):
            finished_at[s.request_id] = step
        if not sched.has_unfinished():
            break
    assert "long" in finished_at
    later = [int(r[5:]) for r in first_step if r.startswith("short") and int(r[5:]) >= 4]
    # shorts that arrived after the long prompt start only once it is admitted
    assert all(first_step[f"short{i}"] >= first_step["long"] for i in later)
    assert finished_at["long"] < 60


def test_preemption_of_the_newest() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b, c = seq(7, "a", 10), seq(7, "b", 10), seq(7, "c", 10)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("a", 7), ("b", 7), ("c", 7)] and sched.bm.num_free_blocks == 0
    apply(sched, out)  # 8 tokens each, 7 computed
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1), ("c", 1)]  # position 7 still fits in the second block
    apply(sched, out)
    out = sched.schedule()  # position 8 needs a third block each: only the newest is pushed out
    assert out.preempted == [c]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.metrics.num_preemptions == 1 and list(sched.waiting) == [c]
    assert c.num_tokens == 9  # nothing it generated is lost
    apply(sched, out)
    outs = run_to_end(sched)
    assert all(s.num_output_tokens == 10 for s in (a, b, c))
    assert sum(len(o.preempted) for o in outs) >= 1


def test_preempted_sequence_returns_in_arrival_order() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, budget=64)
    a, b, c = seq(7, "a", 6), seq(7, "b", 6), seq(3, "c", 2)
    for s in (a, b, c):
        sched.add(s)
    apply(sched, sched.schedule())
    apply(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted == [b]
    assert list(sched.waiting) == [b, c]  # b arrived before c, so it goes ahead of it
    run_to_end(sched)


def test_lone_prompt_larger_than_free_pool_is_chunked() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    s = seq(15, "s", 1)
    sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("s", 15)]
    run_to_end(sched)


def test_finish_removes_waiting_and_running() -> None:
    sched = make_scheduler(budget=8)
    a, b = seq(8, "a"), seq(8, "b")
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert b.status == SequenceStatus.WAITING
    sched.finish(a)
    sched.finish(b)
    assert not sched.has_unfinished() and sched.bm.num_free_blocks == sched.bm.num_blocks
    assert a.is_finished and b.is_finished


def test_waiting_request_does_not_hold_cached_blocks() -> None:
    """A request that hits the prefix cache but cannot be admitted yet must not pin blocks while it waits."""
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, budget=64)
    first = seq(list(range(9)), "first", 1)
    sched.add(first)
    run_to_end(sched)
    assert len(sched.bm.cached_free) == 2
    big = seq(15, "big", 2)  # 4 blocks: all of the free list, none of the cached ones
    sched.add(big)
    apply(sched, sched.schedule())
    assert sched.bm.num_free_blocks == 2 and len(sched.bm.cached_free) == 2
    again = seq(list(range(9)) + list(range(50, 60)), "again", 1)  # 19 tokens: 5 blocks, the first 2 cached
    sched.add(again)
    out = sched.schedule()
    assert plan(out) == [("big", 1)]
    assert again.block_table == [] and again.num_computed_tokens == 0
    assert all(b.ref_count == 0 for b in sched.bm.blocks if b.block_id in sched.bm.cached_free)
    assert sched.bm.num_free_blocks == 2
    run_to_end(sched)
    assert again.metrics.num_cached_prompt_tokens == 8  # the cached blocks were still there once it ran


def test_borrowed_blocks_come_back_even_when_the_work_fails() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    with bm.borrowed(9) as table:
        assert len(table) == 3 and bm.num_free_blocks == 1
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="boom"), bm.borrowed(4):
        raise RuntimeError("boom")
    assert bm.num_free_blocks == 4 and all(b.ref_count == 0 for b in bm.blocks)
    with pytest.raises(ValueError, match="scoring 17 tokens needs 5 free KV blocks, 4 are free"):
        with bm.borrowed(17, "scoring 17 tokens"):
            pass
    assert bm.num_free_blocks == 4
