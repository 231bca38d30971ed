"""Which cached block goes first, on tiny pools with exact block ids: a segmented LRU
(``BlockAllocator``, ``protected_fraction``) where a prefix that was hit outlives a prompt
seen once, protected blocks are capped, a queued request's prefix outlives the prefills
ahead of it, and no order of hits and releases ever evicts a parent before its child."""

from __future__ import annotations

import random

import pytest

from kvindex.hashing import BlockHasher
from replica.engine.blocks.allocator import BlockAllocator
from replica.engine.blocks.audit import check_block_accounting
from replica.engine.blocks.manager import BlockManager
from replica.engine.sequence import Sequence
from replica.sampling.params import SamplingParams

BS = 4
SYSTEM = list(range(8))  # two full blocks every "tenant request" below shares


def manager(num_blocks: int = 8, protected_fraction: float = 0.5) -> BlockManager:
    hasher = BlockHasher(BS, "test-model")
    return BlockManager(num_blocks, BS, hasher, True, protected_fraction)


def served(bm: BlockManager, tokens: list[int], rid: str) -> Sequence:
    """Admit, compute the whole prompt and release, as one short request would."""
    s = Sequence(rid, list(tokens), SamplingParams(), None, arrival_time=0.0)
    n = bm.admit(s, token_budget=10_000)
    assert n is not None
    s.num_computed_tokens += n
    bm.release(s)
    return s


def test_a_prompt_seen_once_is_evicted_before_a_prefix_that_was_hit() -> None:
    bm = manager()
    served(bm, [*SYSTEM, 50], "first")  # blocks 0, 1 (full, published); 2 partial, free
    served(bm, [*SYSTEM, 60], "again")  # hits 0 and 1: both protected once released
    served(bm, list(range(100, 109)), "once")  # blocks 4, 5 published, seen once
    # plain LRU would evict 1, 0 first (released before the one-off prompt's blocks)
    assert bm.allocator.eviction_order() == [5, 4, 1, 0]
    served(bm, list(range(200, 221)), "big")  # 6 blocks: the 4 free ones, then 5 and 4
    assert bm.prefix_cache is not None
    assert bm.prefix_cache.lookup(SYSTEM, None) == [0, 1]  # the hit prefix stayed


def test_with_no_protected_share_it_is_plain_lru() -> None:
    bm = manager(protected_fraction=0.0)
    served(bm, [*SYSTEM, 50], "first")
    served(bm, [*SYSTEM, 60], "again")
    served(bm, list(range(100, 109)), "once")
    assert bm.allocator.eviction_order() == [1, 0, 5, 4]  # release order, tails first


def test_protected_blocks_beyond_the_cap_go_back_on_probation_least_recent_first() -> None:
    bm = manager(protected_fraction=0.25)  # at most 2 of the 8 blocks protected
    other = list(range(300, 308))
    served(bm, [*SYSTEM, 50], "a")  # blocks 0, 1
    served(bm, [*other, 51], "b")  # blocks 3, 4 (and 5, partial: free again)
    served(bm, list(range(100, 105)), "once")  # block 6
    served(bm, [*SYSTEM, 52], "a again")  # 0 and 1 protected: the cap
    assert bm.allocator.eviction_order() == [4, 3, 6, 1, 0]
    served(bm, [*other, 53], "b again")  # 4 and 3 protected; 1 then 0 back on probation
    assert bm.allocator.eviction_order() == [6, 1, 0, 4, 3]


def test_a_block_hit_while_in_use_is_protected_once_released() -> None:
    bm = manager()
    holder = Sequence("holder", [*SYSTEM, 1], SamplingParams(), None, 0.0)
    assert bm.admit(holder, 10_000) == 9
    holder.num_computed_tokens = 9
    served(bm, [*SYSTEM, 2], "sharer")  # hits 0 and 1 while the holder runs
    bm.release(holder)
    served(bm, list(range(100, 109)), "once")
    assert bm.allocator.eviction_order()[-2:] == [1, 0]


def test_a_copied_in_block_is_protected_by_its_second_hit_not_by_the_request_that_brought_it() -> (
    None
):
    """A pull or a restore publishes blocks for one request, which hits them at once: that
    hit is their first use here, as if this replica had computed them."""
    bm = manager()
    served(bm, [*SYSTEM, 50], "first")  # stands in for the import: blocks 0, 1 published
    for block in (0, 1):
        bm.allocator.mark_copied(block)
    served(bm, [*SYSTEM, 60], "the puller")  # its hit is the import's own use
    served(bm, list(range(100, 109)), "once")  # blocks 4, 5
    assert bm.allocator.eviction_order() == [1, 0, 5, 4]  # all on probation: plain LRU
    served(bm, [*SYSTEM, 70], "a real repeat")
    assert bm.allocator.eviction_order()[-2:] == [1, 0]  # now protected


def test_an_evicted_block_forgets_it_was_hit() -> None:
    alloc = BlockAllocator(4, BS, protected_fraction=1.0)
    alloc.mark_hit(2)
    alloc.mark_copied(3)
    assert alloc.allocate(4) == [0, 1, 2, 3]
    assert not alloc._hit[2] and not alloc._copied[3]  # whatever they held is gone


def test_a_queued_request_keeps_its_prefix_while_the_prefills_ahead_evict() -> None:
    """``expect`` (called as a request is queued) makes the cached blocks it will hit the
    most recent, children before parents: the allocations of the prompts admitted ahead
    of it take the other cached blocks first."""
    bm = manager(protected_fraction=0.0)
    served(bm, [*SYSTEM, 50], "tenant")  # blocks 0, 1 cached (2 partial: free)
    served(bm, list(range(100, 109)), "other")  # 3, 4 cached after them
    assert bm.allocator.eviction_order() == [1, 0, 4, 3]
    queued = Sequence("queued", [*SYSTEM, 70], SamplingParams(), None, arrival_time=0.0)
    assert bm.expect(queued) == 2
    assert bm.allocator.eviction_order() == [4, 3, 1, 0]  # the child still before its parent
    served(bm, list(range(200, 221)), "ahead")  # 6 blocks: the 4 free ones, then 4 and 3
    assert bm.admit(queued, token_budget=10_000) == 1  # hits both blocks; 1 token runs
    assert queued.block_table[:2] == [0, 1] and queued.num_cached_prompt_tokens == 8
    check_block_accounting(bm, [queued], [])


def test_expecting_a_prefix_moves_only_cached_blocks_and_changes_no_flag() -> None:
    bm = manager(protected_fraction=0.5)
    served(bm, [*SYSTEM, 50], "first")
    served(bm, [*SYSTEM, 60], "again")  # 0 and 1 protected
    served(bm, list(range(100, 109)), "once")  # 4 and 5 on probation
    running = Sequence("running", list(range(100, 109)), SamplingParams(), None, 0.0)
    assert bm.admit(running, 10_000) == 1  # 4 and 5 in use now
    hits = bytes(bm.allocator._hit)
    for rid in ("a", "b"):  # a prompt in use and a protected one: nothing to move
        bm.expect(Sequence(rid, list(range(100, 109)), SamplingParams(), None, 0.0))
        bm.expect(Sequence(rid, [*SYSTEM, 9], SamplingParams(), None, 0.0))
    assert bm.allocator.eviction_order() == [1, 0] and bytes(bm.allocator._hit) == hits
    check_block_accounting(bm, [running], [])


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_no_mix_of_hits_and_releases_evicts_a_parent_before_its_child(
    fraction: float, seed: int
) -> None:
    """Random tenant requests (three shared heads, random tails) admitted and released in
    random order on a 12-block pool: after every operation the accounting adds up and
    every published block's parent is still the published block it continues."""
    rng = random.Random(seed)
    bm = manager(num_blocks=12, protected_fraction=fraction)
    heads = [list(range(k * 100, k * 100 + 2 * BS)) for k in range(3)]
    running: list[Sequence] = []
    for i in range(300):
        if running and (len(running) > 3 or rng.random() < 0.5):
            bm.release(running.pop(rng.randrange(len(running))))
        else:
            tail = [rng.randrange(4) for _ in range(rng.randrange(2 * BS))]
            s = Sequence(f"r{i}", [*rng.choice(heads), *tail], SamplingParams(), None, 0.0)
            bm.expect(s)  # queued first, as the engine does
            n = bm.admit(s, 10_000)
            if n is not None:
                s.num_computed_tokens += n
                running.append(s)
        check_block_accounting(bm, running, [])
        assert bm.allocator.num_cached <= 12
        bm.allocator.cached.check()  # at most max_protected protected, and the rest
        cache = bm.prefix_cache
        assert cache is not None
        for block in range(12):
            if cache.is_published(block) and (parent := cache.entry(block).parent):
                assert cache.is_published(parent.block_id), (i, block)
                assert cache.entry(parent.block_id) is parent, (i, block)
