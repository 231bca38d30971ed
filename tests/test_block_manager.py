"""Block-level scenarios on tiny pools: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

import kvindex.hashing
from kvindex.hashing import BlockHasher
from replica.engine.blocks.allocator import BlockAllocator, OutOfBlocksError
from replica.engine.blocks.manager import BlockManager
from replica.engine.blocks.prefix_cache import CacheEvents
from replica.engine.sequence import Sequence
from replica.sampling.params import SamplingParams

BS = 4


def manager(num_blocks: int = 8, enable_prefix_cache: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, BlockHasher(BS, "test-model"), enable_prefix_cache)


def seq(tokens: list[int], rid: str = "r", salt: str | None = None) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), salt, arrival_time=0.0)


def run_prefill(bm: BlockManager, s: Sequence) -> int:
    """Admit a sequence and mark its prefill computed, as one engine step would."""
    n = bm.admit(s, token_budget=10_000)
    assert n is not None
    s.num_computed_tokens += n
    return n


def test_allocator_ref_counts_and_atomic_failure() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=BS)
    assert alloc.allocate(3) == [0, 1, 2]
    alloc.share(1)
    assert alloc.ref_counts == [1, 2, 1, 0]
    with pytest.raises(OutOfBlocksError):
        alloc.allocate(2)
    assert alloc.ref_counts == [1, 2, 1, 0]
    assert alloc.num_free == 1
    alloc.free(1)
    alloc.free(1)
    with pytest.raises(ValueError, match="freed more often than held"):
        alloc.free(1)  # never below zero
    with pytest.raises(ValueError, match="block 1 is free"):
        alloc.share(1)  # a free block holds nothing to share
    assert alloc.ref_counts == [1, 0, 1, 0]
    assert alloc.blocks_needed(0) == 0
    assert alloc.blocks_needed(4) == 1
    assert alloc.blocks_needed(5) == 2


def test_shared_full_blocks_get_ref_count_two_and_only_new_blocks_are_allocated() -> None:
    bm = manager()
    a = seq(list(range(10)), "a")  # 2 full blocks + 2 tokens
    assert run_prefill(bm, a) == 10
    assert a.block_table == [0, 1, 2]
    b = seq([*range(8), 50, 51], "b")
    assert bm.admit(b, 10_000) == 2  # only the tail is computed
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_prompt_tokens == 8
    assert bm.allocator.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.allocator.num_free == 4


def test_block_filled_during_decode_is_published_and_the_partial_next_is_not() -> None:
    bm = manager()
    cache = bm.prefix_cache
    assert cache is not None
    s = seq(list(range(7)), "s")  # block 0 full, block 1 has 3 of 4 tokens
    run_prefill(bm, s)
    assert [cache.is_published(b) for b in s.block_table] == [True, False]
    s.token_ids.append(100)  # decode: the token at position 7 fills block 1
    assert bm.append_slot(s)
    assert s.block_table == [0, 1]
    assert cache.is_published(1)
    s.num_computed_tokens += 1
    s.token_ids.append(101)  # position 8 starts block 2
    assert bm.append_slot(s)
    assert s.block_table == [0, 1, 2]
    assert not cache.is_published(2)
    # a later request sharing the generated text hits the block filled during decode
    other = seq([*range(7), 100, 7, 7], "other")
    assert bm.admit(other, 10_000) == 2
    assert other.block_table[:2] == [0, 1]


def test_freed_blocks_are_evicted_tail_first_then_in_release_order() -> None:
    bm = manager()
    a = seq(list(range(13)), "a")  # 3 full blocks + 1 token
    run_prefill(bm, a)
    assert a.block_table == [0, 1, 2, 3]
    bm.release(a)
    assert bm.allocator.eviction_order() == [2, 1, 0]  # the partial block 3 is just free
    b = seq(list(range(100, 109)), "b")
    run_prefill(bm, b)
    assert b.block_table == [4, 5, 6]  # free blocks go before any cached one
    bm.release(b)
    assert bm.allocator.eviction_order() == [2, 1, 0, 5, 4]
    assert bm.allocator.num_free + bm.allocator.num_cached == 8


def test_a_hit_block_is_not_evicted_by_the_allocation_that_follows_it() -> None:
    bm = manager(num_blocks=4)
    x = seq([1, 2, 3, 4, 5], "x")
    run_prefill(bm, x)
    assert x.block_table == [0, 1]
    bm.release(x)  # block 0 cached (the oldest), block 1 free
    y = seq(list(range(100, 109)), "y")
    run_prefill(bm, y)
    assert y.block_table == [2, 3, 1]
    bm.release(y)
    assert bm.allocator.eviction_order() == [0, 3, 2]  # the hit-to-be is first in line
    z = seq([1, 2, 3, 4, *range(200, 209)], "z")  # shares x's block 0, needs 3 more
    assert bm.admit(z, 10_000) == 9
    assert z.block_table == [0, 1, 3, 2]
    assert bm.allocator.ref_counts == [1, 1, 1, 1]
    assert bm.prefix_cache is not None
    assert bm.prefix_cache.num_evictions == 2  # y's blocks went, the hit stayed


def test_a_failed_admission_leaves_every_ref_count_untouched() -> None:
    bm = manager(num_blocks=4)
    a = seq(list(range(9)), "a")
    run_prefill(bm, a)
    before = list(bm.allocator.ref_counts)
    b = seq([*range(8), *range(50, 58)], "b")  # 2 shared + 2 new blocks, only 1 free
    assert bm.admit(b, 10_000) is None
    assert bm.allocator.ref_counts == before
    assert b.block_table == []
    assert b.num_cached_prompt_tokens is None
    assert bm.admit(seq([*range(8), 9], "c"), token_budget=0) is None  # over the budget
    assert bm.allocator.ref_counts == before


def test_salted_namespaces_never_share() -> None:
    bm = manager(num_blocks=16)
    cache = bm.prefix_cache
    assert cache is not None
    tokens = list(range(9))
    t1 = seq(tokens, "t1", salt="tenant-1")
    run_prefill(bm, t1)
    # published under the salted chain: what the index stores and the router computes
    salted = bm.hasher.chain(tokens, "tenant-1")
    assert t1.block_hashes == salted and salted != bm.hasher.chain(tokens)
    events = cache.drain_events()
    assert events is not None and set(events.stored) == set(salted)
    assert cache.lookup(tokens, cache_salt="tenant-1") == t1.block_table[:2]
    assert bm.cached_prefix_tokens(seq(tokens, "probe", salt="tenant-1")) == 8
    assert bm.cached_prefix_tokens(seq(tokens, "probe", salt="tenant-2")) == 0
    assert bm.admit(seq(tokens, "t2", salt="tenant-2"), 10_000) == 9
    assert bm.admit(seq(tokens, "unsalted"), 10_000) == 9
    assert bm.admit(seq(tokens, "t1-again", salt="tenant-1"), 10_000) == 1


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    bm = manager()
    cache = bm.prefix_cache
    assert cache is not None
    s = seq(list(range(9)), "s")
    run_prefill(bm, s)
    assert not bm.reset_prefix_cache()
    assert len(cache) == 2
    bm.release(s)
    assert bm.reset_prefix_cache()
    assert len(cache) == 0
    assert bm.allocator.num_free == 8
    assert cache.lookup(list(range(9))) == []


def test_lookup_stops_at_the_first_miss() -> None:
    bm = manager()
    cache = bm.prefix_cache
    assert cache is not None
    prompt = [*range(16), 99]  # 4 full blocks + 1 token
    s = seq(prompt, "s")
    run_prefill(bm, s)
    table = list(s.block_table)
    bm.release(s)
    bm.allocator.evict(table[1])  # blocks 0, 2 and 3 stay cached
    assert [cache.is_published(b) for b in table[:4]] == [True, False, True, True]
    assert cache.lookup(prompt) == [table[0]]
    again = seq(prompt, "again")
    assert bm.admit(again, 10_000) == len(prompt) - BS
    assert again.num_cached_prompt_tokens == BS


def test_a_shared_middle_block_without_the_shared_start_shares_nothing() -> None:
    bm = manager()
    middle = [7, 7, 7, 7]
    run_prefill(bm, seq([1, 2, 3, 4, *middle, 5], "a"))
    assert bm.prefix_cache is not None
    assert bm.prefix_cache.lookup([9, 9, 9, 9, *middle, 5]) == []


def test_a_forced_hash_collision_never_gives_a_wrong_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvindex.hashing, "_digest", lambda data, key: b"\x00" * 16)
    bm = manager()
    cache = bm.prefix_cache
    assert cache is not None
    a = seq([*range(8), 1], "a")
    run_prefill(bm, a)
    # every block of every prompt now has the same hash; tokens differ
    assert cache.lookup([*range(100, 108), 1]) == []
    assert cache.num_hash_mismatches == 1
    # same first block, different second one: only the first is shared
    assert cache.lookup([*range(4), 9, 9, 9, 9, 1]) == [a.block_table[0]]
    # the true prefix still hits in full
    assert cache.lookup([*range(8), 1]) == a.block_table[:2]
    # same tokens under another salt: the root differs in content, not in hash
    assert cache.lookup([*range(8), 1], cache_salt="other") == []


def test_events_report_stored_and_removed_hashes_once() -> None:
    bm = manager(num_blocks=3)
    cache = bm.prefix_cache
    assert cache is not None
    a = seq(list(range(9)), "a")
    run_prefill(bm, a)
    hashes = list(a.block_hashes)
    events = cache.drain_events()
    assert events is not None
    assert set(events.stored) == set(hashes) and events.removed == ()
    assert cache.drain_events() is None
    bm.release(a)
    run_prefill(bm, seq(list(range(100, 109)), "b"))  # evicts both of a's blocks
    events = cache.drain_events()
    assert events is not None
    assert set(events.removed) == set(hashes)
    assert cache.cached_hashes().isdisjoint(hashes)


def test_a_hit_needs_its_parent_to_be_the_block_matched_just_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parent check, reached: with every hash equal, block 1 of ``[C|B|t]`` finds a cached
    block holding exactly its tokens (``B``), but that block continues ``A``, not ``C``.
    Equal tokens are not enough: taking it would hand this request the keys and values of
    another sequence's context (``B`` attended over ``A``). It must stop after ``C``."""
    monkeypatch.setattr(kvindex.hashing, "_digest", lambda data, key: b"\x00" * 16)
    bm = manager()
    cache = bm.prefix_cache
    assert cache is not None
    a, b, c, d = [1] * BS, [2] * BS, [3] * BS, [4] * BS
    ab = seq([*a, *b, 9], "ab")
    run_prefill(bm, ab)
    cd = seq([*c, *d, 9], "cd")
    run_prefill(bm, cd)
    assert ab.block_table == [0, 1, 2] and cd.block_table == [3, 4, 5]
    mismatches = cache.num_hash_mismatches  # cd's own lookup already missed on A's block
    assert cache.lookup([*c, *b, 9]) == [3]  # not [0, 1] (ab's), not [3, 1] (a spliced chain)
    assert cache.num_hash_mismatches == mismatches + 1
    cb = seq([*c, *b, 9], "cb")
    assert bm.admit(cb, 10_000) == BS + 1  # B and the tail are computed, over cd's C
    assert cb.block_table == [3, 6, 7]
    assert bm.allocator.ref_counts == [1, 1, 1, 2, 1, 1, 1, 1]


def test_a_fork_shares_full_blocks_and_copies_the_partial_one_if_a_block_is_left() -> None:
    """Another choice of the same request (``n`` > 1) shares the parent's full blocks and
    gets its own copy of the partial last block, copied before the next forward pass. The
    copy needs exactly one available block; without one the fork is refused, changing
    nothing. A parent without a partial block needs none."""
    bm = manager(num_blocks=4)
    parent = seq(list(range(6)), "p")  # block 0 full, block 1 holds 2 tokens
    run_prefill(bm, parent)
    run_prefill(bm, seq([50, 51, 52], "other"))  # block 2: one block is left
    assert parent.block_table == [0, 1] and bm.allocator.num_available == 1
    child = seq(list(range(6)), "p#1")
    assert bm.fork(parent, child)
    assert child.block_table == [0, 3] and child.num_computed_tokens == 6
    assert bm.take_copies() == [(1, 3)] and bm.take_copies() == []
    assert bm.allocator.ref_counts == [2, 1, 1, 1]
    refused = seq(list(range(6)), "p#2")
    assert not bm.fork(parent, refused)
    assert refused.block_table == [] and bm.take_copies() == []
    assert bm.allocator.ref_counts == [2, 1, 1, 1]
    whole = seq(list(range(8)), "w")  # ends on a block boundary: nothing to copy
    bm.release(child)
    run_prefill(bm, whole)
    assert whole.block_table == [0, 3] and bm.allocator.num_available == 0
    twin = seq(list(range(8)), "w#1")
    assert bm.fork(whole, twin)
    assert twin.block_table == [0, 3] and bm.take_copies() == []


def test_a_reset_is_reported_once_as_cleared() -> None:
    """``CacheEvents.cleared`` is True in the one batch after a reset, False after it."""
    bm = manager()
    cache = bm.prefix_cache
    assert cache is not None
    s = seq(list(range(5)), "s")
    run_prefill(bm, s)
    bm.release(s)
    assert cache.drain_events() == CacheEvents(stored=(s.block_hashes[0],), removed=())
    assert bm.reset_prefix_cache()
    assert cache.drain_events() == CacheEvents(stored=(), removed=(), cleared=True)
    again = seq(list(range(5)), "again")
    assert bm.admit(again, 10_000) == 5  # nothing cached any more
    assert cache.drain_events() == CacheEvents(
        stored=(again.block_hashes[0],), removed=(), cleared=False
    )


def test_a_released_sequence_holds_nothing_and_a_fork_of_it_is_refused() -> None:
    """Release (finish, abort, preemption) empties a sequence's table and its counts: it has
    computed and published nothing any more. Choices fork from a parent that may have been
    released in the step that sampled its first token (it ended there, or was preempted);
    the fork is then refused, changing nothing, and the child waits to recompute its prompt
    (from whatever the cache still holds): a running child with no blocks would crash the
    next step."""
    bm = manager()
    parent = seq(list(range(6)), "p")
    run_prefill(bm, parent)
    bm.release(parent)
    assert parent.block_table == []
    assert parent.num_computed_tokens == 0 and parent.num_published_blocks == 0
    child = seq(list(range(6)), "p#1")
    assert not bm.fork(parent, child)
    assert child.block_table == [] and child.num_computed_tokens == 0
    assert bm.take_copies() == [] and bm.allocator.num_in_use == 0


def test_cached_prefix_tokens_predicts_exactly_what_admit_takes() -> None:
    """The probe the scheduler prices whole prompts with equals what ``admit`` then shares:
    whole cached blocks, capped to leave the last prompt token to compute; 0 without a cache."""
    bm = manager()
    run_prefill(bm, seq(list(range(9)), "a"))  # blocks 0 and 1 published
    exact = seq(list(range(8)), "exact")  # both full blocks cached, but the last token runs
    assert bm.cached_prefix_tokens(exact) == BS
    longer = seq([*range(8), 50], "longer")
    assert bm.cached_prefix_tokens(longer) == 2 * BS
    for probe in (exact, longer):
        predicted = bm.cached_prefix_tokens(probe)
        assert bm.admit(probe, 10_000) == probe.num_tokens - predicted
        assert probe.num_cached_prompt_tokens == predicted
    off = manager(enable_prefix_cache=False)
    run_prefill(off, seq(list(range(9)), "a"))
    assert off.cached_prefix_tokens(seq(list(range(9)), "again")) == 0


def test_every_eviction_gives_the_block_a_newer_generation() -> None:
    """A peer copying a block trusts it only if its generation is the same before and after
    (``shared_pool.read_blocks``): each eviction must move it to a value it never had, never
    negative (-1 is what a short read of the generations returns)."""
    bm = manager(num_blocks=1)
    alloc = bm.allocator
    seen = [alloc.generations[0]]
    for rid in ("a", "b", "c"):
        s = seq([7, 7, 7, 7], rid)  # one full block, published by its prefill
        run_prefill(bm, s)
        assert s.block_table == [0]
        bm.release(s)
        assert alloc.eviction_order() == [0]
        alloc.evict(0)
        seen.append(alloc.generations[0])
    assert seen[0] == 0 and seen == sorted(set(seen))  # strictly increasing from 0


def test_an_empty_pool_or_an_empty_block_is_refused() -> None:
    """A pool with no block (or blocks of no token) could never admit anyone: the engine
    would wait forever, so the allocator refuses it when it is built."""
    for num_blocks, block_size in ((0, BS), (-1, BS), (4, 0), (0, 0)):
        with pytest.raises(ValueError, match="num_blocks and block_size must be positive"):
            BlockAllocator(num_blocks, block_size)
    assert BlockAllocator(1, 1).num_free == 1


def test_a_hasher_for_another_block_size_is_refused() -> None:
    """Block hashes must cover exactly one block: a hasher built for another size would
    publish hashes no router or peer computes for these blocks."""
    with pytest.raises(ValueError, match="hasher and block manager disagree on block_size"):
        BlockManager(8, BS, BlockHasher(2 * BS, "test-model"), True)


def test_a_one_token_budget_admits_a_prompt_and_runs_one_token() -> None:
    """The last token of a step's budget still admits a waiting prompt: it gets the blocks
    of its whole prompt and computes one token now, the rest in later chunks."""
    bm = manager()
    s = seq(list(range(6)), "s")
    assert bm.admit(s, token_budget=1) == 1
    assert s.block_table == [0, 1] and s.num_computed_tokens == 0
    s.num_computed_tokens += 1
    assert bm.schedule_chunk(s, 10_000) == 5
