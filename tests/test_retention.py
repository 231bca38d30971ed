"""Sessions' retained blocks (``replica.engine.blocks.retention``): exact block ids on tiny
pools, then the engine: a pinned conversation survives a flood that evicts everything
else, goes at its TTL, and changes no output; block accounting checked after each step."""

from __future__ import annotations

import pytest
from conftest import run_to_end, tiny

from kvindex.hashing import BlockHasher
from replica.engine.blocks.audit import check_block_accounting
from replica.engine.blocks.manager import BlockManager
from replica.engine.engine import Engine
from replica.engine.sequence import Sequence
from replica.messages import Retention
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def finished(bm: BlockManager, tokens: list[int], rid: str, retention: Retention | None) -> None:
    """A request that computed ``tokens`` and finished: retained if asked, then released."""
    seq = Sequence(rid, list(tokens), SamplingParams(), None, arrival_time=0.0)
    n = bm.admit(seq, token_budget=10_000)
    assert n is not None
    seq.num_computed_tokens += n
    seq.retention = retention
    bm.retain(seq)
    bm.release(seq)
    check_block_accounting(bm, [], [])


def pool(num_blocks: int, pinned: float, clock: Clock) -> BlockManager:
    bm = BlockManager(num_blocks, BS, BlockHasher(BS, "test-model"), True, 0.0, pinned)
    bm.pins.clock = clock
    return bm


def test_a_pinned_session_survives_a_flood_and_goes_at_its_ttl() -> None:
    clock = Clock()
    bm = pool(8, 0.5, clock)
    turn = list(range(13))  # 3 full blocks and one token
    finished(bm, turn, "t1", Retention("s", "a", ttl_s=30))
    assert bm.pins.held == 3 and bm.allocator.num_in_use == 3
    for i in range(4):  # each takes the 5 other blocks: everything unpinned is evicted
        finished(bm, [100 * (i + 1) + t for t in range(20)], f"flood{i}", None)
    assert bm.prefix_cache is not None
    assert len(bm.prefix_cache.lookup(turn)) == 3  # the session's blocks are still there
    clock.now = 29.0
    assert bm.pins.expire() == pytest.approx(1.0) and bm.pins.held == 3
    clock.now = 30.0
    assert bm.pins.expire() is None and bm.pins.held == 0
    assert bm.allocator.num_in_use == 0 and bm.allocator.num_cached == 8  # cached, evictable
    finished(bm, [900 + t for t in range(32)], "flood-after", None)
    assert bm.prefix_cache.lookup(turn) == []
    assert bm.pins.counters.expired == 1


def test_the_next_turn_replaces_the_pin_and_ttl_zero_ends_the_session() -> None:
    clock = Clock()
    bm = pool(16, 0.5, clock)
    first = list(range(9))  # 2 full blocks
    finished(bm, first, "t1", Retention("s", "a", 30))
    second = [*first, *range(50, 58)]  # the conversation grown: 4 full blocks, 2 shared
    finished(bm, second, "t2", Retention("s", "a", 30))
    assert bm.pins.held == 4 and bm.allocator.num_in_use == 4  # the old pin's 2 went
    assert bm.pins.counters.renewed == 1
    finished(bm, [*second, 60], "t3", Retention("s", "a", 0))  # its last turn
    assert bm.pins.held == 0 and bm.allocator.num_in_use == 0 and len(bm.pins) == 0
    assert bm.pins.counters.ended == 1


def test_pins_stay_in_their_bound_and_a_tenants_flood_releases_its_own_first() -> None:
    """Bound 4 blocks (of 12): tenant b pins 1 block, tenant a 3 sessions of 1 block;
    a's next pin releases a's oldest, never b's; a pin longer than the bound keeps a
    prefix of it."""
    clock = Clock()
    bm = pool(12, 0.35, clock)
    finished(bm, [*range(100, 104), 1], "b1", Retention("b-s", "b", 60))
    for i in range(3):
        finished(bm, [*range(10 * i, 10 * i + 4), 1], f"a{i}", Retention(f"a-s{i}", "a", 60))
    assert bm.pins.held == 4 and bm.pins.held_by("a") == 3
    finished(bm, [*range(40, 44), 1], "a3", Retention("a-s3", "a", 60))
    assert bm.pins.held_by("b") == 1 and bm.pins.held_by("a") == 3
    assert bm.pins.counters.released_for_room == 1
    assert bm.prefix_cache is not None
    assert bm.prefix_cache.lookup([*range(100, 104), 1])  # b's block, still held
    long = list(range(200, 221))  # 5 full blocks: the first 4 are kept, b's own pin and
    # then a's released for them (b, counting them, holds the most)
    finished(bm, long, "b2", Retention("b-s2", "b", 60))
    assert bm.pins.held == 4 and bm.pins.held_by("b") == 4 and bm.pins.held_by("a") == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the dtype served
def test_an_engine_keeps_a_sessions_prefix_through_a_flood_and_changes_no_output(
    dtype: str,
) -> None:
    """A tiny pool (8 blocks of 16): a session's turn, then one-off prompts that take every
    block, then its next turn. Retained: the next turn hits its whole prefix (3 blocks);
    not retained: nothing. Greedy tokens are the same either way; accounting after every
    step; once the TTL passes (the engine idle, as a replica's loop expires it) no block
    stays in use."""
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    turn = [256, *range(1, 40)]  # 40 tokens
    outs = {}
    for retained in (True, False):
        engine = build_engine(tiny(num_blocks=8, block_size=16, max_num_seqs=4, dtype=dtype))
        clock = Clock()
        engine.block_manager.pins.clock = clock
        retention = Retention("s", "default", 30) if retained else None
        engine.add_request("t1", turn, greedy, retention=retention)
        first = run_to_end(engine, "t1")
        for i in range(3):
            _run_new(
                engine, f"flood{i}", [250 - i, *((7 * t + 13 * i) % 250 for t in range(59))], greedy
            )
        nxt = [*turn, *first.token_ids, 5, 6]
        engine.add_request("t2", nxt, greedy, retention=retention)
        outs[retained] = (first.token_ids, run_to_end(engine, "t2"))
        if retained:
            assert engine.stats().blocks_pinned == 3  # t2's 3 full blocks replaced t1's 2
            clock.now = 31.0
            assert engine.expire_retention() is None
            engine.check_invariants(idle=True)
            assert engine.block_manager.allocator.num_in_use == 0
    assert outs[True][1].num_cached_tokens == 32  # t1 computed 47 tokens: 2 full blocks
    assert outs[False][1].num_cached_tokens == 0
    assert outs[True][0] == outs[False][0]
    assert outs[True][1].token_ids == outs[False][1].token_ids


def _run_new(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> None:
    engine.add_request(rid, prompt, params)
    run_to_end(engine, rid)


def test_pins_yield_to_a_request_that_could_not_run_beside_them() -> None:
    """8 blocks of 16, pins bounded to 4: two sessions hold 2 blocks each. A prompt that
    needs 7 blocks, with nothing running that could free any, releases them (oldest first)
    instead of waiting for their TTLs; its tokens are those of an engine without pins."""
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    big = [250, *range(1, 97)]  # 97 tokens + 8: 7 blocks
    engine = build_engine(tiny(num_blocks=8, block_size=16, max_num_seqs=4))
    for i in range(2):
        session = [240 + i, *range(100, 139)]  # 40 tokens + 8: 2 full blocks computed
        engine.add_request(f"s{i}", session, greedy, retention=Retention(f"s{i}", "a", 300))
        run_to_end(engine, f"s{i}")
    assert engine.stats().blocks_pinned == 4
    engine.add_request("big", big, greedy)
    out = run_to_end(engine, "big")
    stats = engine.stats()
    assert stats.retention_released_for_room == 2 and stats.blocks_pinned == 0
    plain = build_engine(tiny(num_blocks=8, block_size=16, max_num_seqs=4))
    assert plain.generate([big], greedy)[0].token_ids == out.token_ids


def test_a_reset_drops_the_pins_but_is_refused_while_a_request_holds_a_pinned_block() -> None:
    clock = Clock()
    bm = pool(8, 0.5, clock)
    turn = list(range(9))  # 2 full blocks
    finished(bm, turn, "t1", Retention("s", "a", 30))
    running = Sequence("next", [*turn, 50], SamplingParams(), None, arrival_time=0.0)
    assert bm.admit(running, token_budget=10_000) is not None  # shares the pinned blocks
    assert not bm.reset_prefix_cache() and bm.pins.held == 2
    bm.release(running)
    assert bm.reset_prefix_cache()
    assert bm.pins.held == 0 and len(bm.pins) == 0 and bm.allocator.num_free == 8
    check_block_accounting(bm, [], [])
