"""The scheduler on tiny pools: chunked prefill, admission reserve and preemption, with
exact block ids and publish order. Steps are simulated (no model): a scheduled chunk is
computed, and a chunk that reaches the last token appends a generated one."""

from __future__ import annotations

import pytest

import replica.engine.scheduler
from kvindex.hashing import BlockHasher
from replica.engine.blocks.manager import BlockManager
from replica.engine.scheduler import Scheduler
from replica.engine.sequence import Sequence, SequenceStatus
from replica.engine.step import ScheduledBatch
from replica.sampling.params import SamplingParams

BS = 4


def scheduler(num_blocks: int, budget: int, max_num_seqs: int = 4, **kw) -> Scheduler:
    manager = BlockManager(num_blocks, BS, BlockHasher(BS, "test-model"), True)
    return Scheduler(manager, max_num_seqs, budget, **kw)


def seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), None, 0.0)


def step(s: Scheduler, next_token: int = 999) -> ScheduledBatch:
    """One step: schedule, then compute what was scheduled, as the engine does."""
    batch = s.schedule()
    if s.chunked_prefill:
        assert batch.num_tokens <= s.max_num_batched_tokens  # the budget is never exceeded
    for q, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.samples, strict=True):
        q.num_computed_tokens += n
        if sample:
            q.token_ids.append(next_token)
    return batch


def stored(s: Scheduler, q: Sequence) -> list[int]:
    """Which of ``q``'s blocks the last step published (by position in its block table)."""
    cache = s.block_manager.prefix_cache
    events = cache.drain_events()
    hashes = set(events.stored) if events else set()
    return [i for i, h in enumerate(q.block_hashes) if h in hashes]


def test_a_five_block_prompt_with_a_two_block_budget_takes_three_steps() -> None:
    s = scheduler(num_blocks=8, budget=2 * BS)
    a = seq("a", list(range(20)))  # 5 full blocks
    s.add(a)
    plan = []
    for _ in range(3):
        batch = step(s)
        plan.append((batch.num_new_tokens, batch.samples, list(a.block_table), stored(s, a)))
    assert plan == [
        ([8], [False], [0, 1, 2, 3, 4], [0, 1]),  # all prompt blocks taken at admission
        ([8], [False], [0, 1, 2, 3, 4], [2, 3]),
        ([4], [True], [0, 1, 2, 3, 4], [4]),  # the last chunk samples the first token
    ]
    assert a.num_output_tokens == 1
    batch = step(s)  # now a plain decode, in a new block
    assert batch.num_new_tokens == [1] and a.block_table == [0, 1, 2, 3, 4, 5]


def test_a_second_request_hits_blocks_of_a_prompt_still_being_chunked() -> None:
    s = scheduler(num_blocks=16, budget=2 * BS)
    a = seq("a", list(range(20)))
    s.add(a)
    step(s)  # a: tokens 0-7 computed, blocks 0 and 1 published
    b = seq("b", [*range(8), 50, 51, 52])  # shares a's first two blocks
    s.add(b)
    batch = step(s)  # a's second chunk takes the whole budget: b waits
    assert batch.seqs == [a] and b.status is SequenceStatus.WAITING
    batch = step(s)  # a's last 4 tokens, then b with what is left
    assert batch.seqs == [a, b] and batch.num_new_tokens == [4, 3]
    assert b.num_cached_prompt_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert s.block_manager.allocator.ref_counts[a.block_table[0]] == 2


def test_decodes_go_first_and_prompts_take_the_rest_of_the_budget() -> None:
    s = scheduler(num_blocks=32, budget=6)
    d1, d2 = seq("d1", [1, 2, 3], 10), seq("d2", [4, 5, 6], 10)
    s.add(d1)
    s.add(d2)
    step(s)  # both prompts (3 + 3 tokens) in one step
    long = seq("long", list(range(100, 120)))
    s.add(long)
    batch = step(s)
    assert batch.seqs == [d1, d2, long] and batch.num_new_tokens == [1, 1, 4]
    batch = step(s)
    assert batch.seqs == [d1, d2, long] and batch.num_new_tokens == [1, 1, 4]


def test_preemption_mid_chunk_takes_the_newest_and_it_resumes_from_its_cached_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replica.engine.scheduler, "_RATIO_MIN", 0.0)
    s = scheduler(num_blocks=7, budget=8)
    old = seq("old", [7] * 6, max_tokens=8)  # 2 blocks, grows into a third
    s.add(old)
    step(s)
    new = seq("new", list(range(200, 220)))  # 5 blocks: all that is left
    s.reserve_ratio = 0.0  # admit without a reserve, to force the preemption below
    s.add(new)
    batch = step(s)
    assert batch.seqs == [old, new] and batch.num_new_tokens == [1, 7]
    assert new.block_table == [2, 3, 4, 5, 6]
    while not (batch := step(s)).preempted:  # old fills its 2 blocks while new is chunked
        assert batch.seqs == [old, new]
    # old needs a third block: none free, none cached -> the newest, mid-chunk, gives way
    assert batch.preempted == [new] and batch.seqs == [old]
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and s.waiting[0] is new
    assert s.reserve_ratio == 1.0  # after a preemption, reserve every token again
    # its three full blocks stay cached (tail first in line); old took a free block
    assert s.block_manager.allocator.eviction_order() == [4, 3, 2]
    assert old.block_table == [0, 1, 6]
    while old.num_output_tokens < 8:
        step(s)
    s.remove(old)  # finished: its blocks go back
    batch = step(s)
    assert batch.seqs == [new] and batch.num_new_tokens == [20 - 3 * BS]  # only what was lost
    assert new.num_computed_tokens == 20 and new.num_output_tokens == 1
    assert new.num_cached_prompt_tokens == 0  # counted once, at its first admission


def test_admission_keeps_a_reserve_for_running_requests_to_grow() -> None:
    s = scheduler(num_blocks=9, budget=64)
    a = seq("a", [1] * 8, max_tokens=16)  # 2 blocks now, up to 6 once it has generated 16
    s.add(a)
    step(s)
    s.reserve_ratio = 1.0
    b = seq("b", [2] * 13, max_tokens=2)  # 4 blocks; a decodes into a third: 6 - 4 < 4
    s.add(b)
    assert s.reserve_blocks() == 4  # 15 tokens still to come for a: 4 blocks
    batch = step(s)
    assert batch.seqs == [a] and b.status is SequenceStatus.WAITING
    s.reserve_ratio = 0.5  # half of a's 14 tokens to come: 2 blocks, and 3 + 4 + 2 = 9 fits
    batch = step(s)
    assert batch.seqs == [a, b]


def test_without_chunking_a_lone_long_prompt_runs_whole_over_the_budget() -> None:
    s = scheduler(num_blocks=16, budget=8, chunked_prefill=False)
    a, b = seq("a", list(range(20))), seq("b", list(range(40, 60)))
    s.add(a)
    s.add(b)
    batch = step(s)
    assert batch.seqs == [a] and batch.num_new_tokens == [20]  # b would overrun again
    batch = step(s)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 20]


def test_preemption_takes_the_newest_not_the_oldest_nor_the_one_that_needs_the_block() -> None:
    """Newest first (README, "Memory pressure"): three decoding requests, oldest to newest
    ``a``, ``b``, ``c``, in a pool with no free or cached block left. ``b`` (the middle one)
    needs a new block; ``c`` gives its block up. Oldest first would take ``a``, and
    preempting whoever needs the slot would take ``b``."""
    s = scheduler(num_blocks=3, budget=64, decode_reserve=False)
    a = seq("a", [10, 11], max_tokens=8)  # 2 of 4 slots: its next decode fits
    b = seq("b", [20, 21, 22, 23], max_tokens=8)  # a full block: its next token needs one
    c = seq("c", [30, 31], max_tokens=8)  # fits too, but it is the newest
    for q in (a, b, c):
        s.add(q)
    batch = step(s)
    assert batch.seqs == [a, b, c] and [q.block_table for q in (a, b, c)] == [[0], [1], [2]]
    batch = step(s)
    assert batch.preempted == [c]
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 1]
    assert b.block_table == [1, 2]  # c's partial block, unpublished: free, then b's
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and list(s.waiting) == [c]
    assert c.num_computed_tokens == 0 and c.num_output_tokens == 1  # recomputed, token kept
    assert a.status is b.status is SequenceStatus.RUNNING


def test_cached_blocks_are_evicted_before_anyone_is_preempted() -> None:
    """The allocator gives up cached prefixes before the scheduler preempts anyone: two
    decodes that each need a block take the two cached ones (no preemption), and only when
    nothing free or cached is left is the newest request preempted."""
    s = scheduler(num_blocks=5, budget=64, decode_reserve=False)
    x = seq("x", list(range(8)), max_tokens=1)  # 2 full blocks, published
    s.add(x)
    step(s)
    s.remove(x)  # finished: blocks 0 and 1 stay cached, tail first in line
    allocator = s.block_manager.allocator
    cache = s.block_manager.prefix_cache
    assert allocator.eviction_order() == [1, 0] and allocator.num_free == 3
    a = seq("a", [10, 11], max_tokens=8)
    b = seq("b", [20, 21, 22, 23], max_tokens=8)
    c = seq("c", [30, 31, 32, 33], max_tokens=8)
    for q in (a, b, c):
        s.add(q)
    step(s)
    assert [q.block_table for q in (a, b, c)] == [[2], [3], [4]]  # free blocks first
    assert allocator.num_free == 0 and allocator.num_cached == 2
    batch = step(s)  # b and c each need a block: both cached blocks go, nobody is preempted
    assert batch.preempted == [] and batch.seqs == [a, b, c]
    assert b.block_table == [3, 1] and c.block_table == [4, 0]
    assert cache.num_evictions == 2 and allocator.num_available == 0
    step(s)  # nobody needs a block
    batch = step(s)  # a needs one; nothing free or cached: the newest gives way
    assert batch.preempted == [c] and batch.seqs == [a, b]
    assert a.block_table == [2, 0]  # c's partial block 0; its full block 4 stays cached
    assert allocator.eviction_order() == [4] and cache.num_evictions == 2


def test_a_batch_asks_for_logits_only_where_it_samples_or_scores_the_prompt() -> None:
    """``logit_rows``: the model computes logits only for the rows a step uses: the row
    it samples from, or every prompt row of a request asking for prompt logprobs (and
    only while its prompt is being computed, not when its generated tokens are recomputed
    after a preemption)."""
    plain = seq("plain", list(range(5)))
    scored = Sequence("scored", list(range(5)), SamplingParams(prompt_logprobs=1), None, 0.0)
    batch = ScheduledBatch()
    batch.add(plain, 3)  # a chunk that does not reach the end: nothing to sample
    batch.add(scored, 3)  # its first 3 prompt rows
    scored.num_computed_tokens = 3
    batch.add(scored, 2)  # the last 2 prompt rows, the last one sampled
    scored.token_ids += [7, 8]  # two generated tokens, then preempted: all to recompute
    scored.num_computed_tokens = 5
    batch.add(scored, 1)  # its first generated token: past the prompt, no sample
    assert batch.logit_rows == [0, 3, 2, 0]
    assert batch.samples == [False, False, True, False]


def test_the_budget_must_cover_one_token_per_sequence() -> None:
    manager = BlockManager(8, BS, BlockHasher(BS, "test-model"), True)
    assert Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=4).max_num_seqs == 4
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least max_num_seqs"):
        Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=3)


def test_a_forked_choice_joins_the_running_and_decodes_with_its_parent() -> None:
    """``add_running``: a choice forked from its parent's prefill holds its blocks already;
    it is running (not waiting to be admitted) and decodes in the next step, after the copy
    of its partial block."""
    s = scheduler(num_blocks=8, budget=64)
    parent = seq("p", list(range(6)))  # block 0 full, block 1 holds 2 tokens
    s.add(parent)
    step(s)
    child = seq("p#1", list(range(6)))
    child.num_computed_tokens = 6
    assert s.block_manager.fork(parent, child)
    s.add_running(child)
    assert child.status is SequenceStatus.RUNNING and list(s.waiting) == []
    child.token_ids.append(555)  # its own first token
    batch = step(s)
    assert batch.seqs == [parent, child] and batch.num_new_tokens == [1, 1]
    assert batch.block_copies == [(1, 2)] and child.block_table == [0, 2]


def test_removing_a_waiting_request_takes_it_out_of_the_queue() -> None:
    """``remove`` (an abort) of a request not yet admitted: it leaves the waiting queue and is
    never scheduled; the running one is untouched."""
    s = scheduler(num_blocks=8, budget=64, max_num_seqs=1)
    a, b = seq("a", [1, 2, 3]), seq("b", [4, 5, 6])
    s.add(a)
    s.add(b)
    step(s)
    assert list(s.waiting) == [b] and s.running == [a]  # one sequence slot: b waits
    s.remove(b)
    assert list(s.waiting) == [] and s.running == [a] and b.block_table == []
    s.remove(a)
    assert s.num_unfinished == 0 and s.block_manager.allocator.num_in_use == 0
    assert len(step(s)) == 0


def test_the_last_token_of_the_budget_still_goes_to_a_prompt() -> None:
    """Budget 4, three decodes: the one token left admits a waiting prompt (a one-token
    chunk), and in the next step goes to that prompt's next chunk."""
    s = scheduler(num_blocks=16, budget=4)
    decodes = [seq(f"d{i}", [i]) for i in range(3)]
    long = seq("long", list(range(100, 120)))
    for q in (*decodes, long):
        s.add(q)
    batch = step(s)  # three one-token prompts, then one token of the long one
    assert batch.seqs == [*decodes, long] and batch.num_new_tokens == [1, 1, 1, 1]
    assert long.status is SequenceStatus.RUNNING and long.block_table == [3, 4, 5, 6, 7]
    batch = step(s)  # three decodes, then the long prompt's next token
    assert batch.seqs == [*decodes, long] and batch.num_new_tokens == [1, 1, 1, 1]
    assert long.num_computed_tokens == 2


def test_a_choice_that_preempts_itself_leaves_the_prompt_chunk_after_it_scheduled() -> None:
    """A forked choice joins the running after a prompt still being chunked, so it is the
    newest: when its decode finds no block it gives way itself, and the older prompt's next
    chunk (scheduled after every decode) still runs in that step."""
    s = scheduler(num_blocks=7, budget=8, decode_reserve=False)
    p = seq("p", [1, 2, 3, 4])  # one full block: its next token needs a new one
    long = seq("long", list(range(100, 120)))  # 5 blocks, 4 of its tokens in step 1
    s.add(p)
    s.add(long)
    batch = step(s)
    assert batch.seqs == [p, long] and batch.num_new_tokens == [4, 4]
    assert p.block_table == [0] and long.block_table == [1, 2, 3, 4, 5]
    child = seq("p#1", [1, 2, 3, 4])
    child.num_computed_tokens = 4
    assert s.block_manager.fork(p, child) and child.block_table == [0]
    s.add_running(child)
    child.token_ids.append(555)
    batch = step(s)  # p takes the last free block; the child finds none and is the newest
    assert batch.preempted == [child] and child.status is SequenceStatus.WAITING
    assert batch.seqs == [p, long] and batch.num_new_tokens == [1, 7]
    assert p.block_table == [0, 6]


def test_without_chunking_a_later_prompt_joins_only_if_its_uncached_rest_fits() -> None:
    """With chunking off only a step's first prompt may overrun the budget; each later one
    joins if its tokens not served by the cache fit in what is left (exactly is enough),
    and otherwise waits for the next step."""
    s = scheduler(32, budget=8, max_num_seqs=8, chunked_prefill=False, decode_reserve=False)
    x = seq("x", list(range(9)))  # publishes blocks 0-3 and 4-7
    s.add(x)
    assert step(s).num_new_tokens == [9]
    w = seq("w", [60, 61, 62, 63, 64])
    y = seq("y", [*range(8), 50, 51])  # 10 tokens, 8 of them cached: 2 to compute
    s.add(w)
    s.add(y)
    batch = step(s)  # x decodes (7 left), w takes 5 (2 left), y's 2 fit exactly
    assert batch.seqs == [x, w, y] and batch.num_new_tokens == [1, 5, 2]
    assert y.num_cached_prompt_tokens == 8 and y.block_table[:2] == x.block_table[:2]
    z, u = seq("z", [70, 71, 72, 73]), seq("u", [80, 81])
    s.add(z)
    s.add(u)
    batch = step(s)  # three decodes (5 left), z takes 4 (1 left): u's 2 do not fit
    assert batch.seqs == [x, w, y, z] and batch.num_new_tokens == [1, 1, 1, 4]
    assert list(s.waiting) == [u] and u.block_table == []


def test_without_chunking_a_prompt_scored_whole_runs_in_one_step_despite_a_cached_head() -> None:
    """A request with prompt logprobs takes nothing from the cache (its every prompt row is
    scored), so in whole-prompts mode it is sized without the cached head and runs in one
    step, not split by a cache hit ``admit`` never takes."""
    s = scheduler(num_blocks=16, budget=8, chunked_prefill=False)
    warm = seq("warm", list(range(12)), max_tokens=1)
    s.add(warm)
    step(s)
    s.remove(warm)  # its 2 full blocks stay cached
    assert s.block_manager.cached_prefix_tokens(seq("probe", list(range(12)))) == 8
    scored = Sequence("scored", list(range(12)), SamplingParams(prompt_logprobs=1), None, 0.0)
    assert s.block_manager.cached_prefix_tokens(scored) == 0
    s.add(scored)
    batch = step(s)
    assert batch.seqs == [scored] and batch.num_new_tokens == [12]


def test_a_higher_priority_prompt_shares_its_steps_with_decodes_only() -> None:
    """Two low-priority prompts are being chunked and one low request decodes when an
    urgent one arrives: from the next step only its chunks (and the decode) run, ahead of
    an older low-priority request still waiting; once its prompt is computed the others
    resume. With equal priorities the order is the arrival order."""
    s = scheduler(num_blocks=64, budget=3 * BS, max_num_seqs=5)
    low = [seq(f"low{i}", list(range(100 * i, 100 * i + 9 * BS)), max_tokens=8) for i in range(2)]
    decoding = seq("dec", [7] * 3)
    for q in (decoding, *low):
        s.add(q)
    step(s)  # dec's prompt whole, then low0's first chunk
    waiting_low = seq("low-late", list(range(500, 500 + 2 * BS)))
    urgent = seq("urgent", list(range(900, 900 + 5 * BS)))
    urgent.priority = 5
    s.add(waiting_low)
    s.add(urgent)
    plans = []
    while urgent.num_computed_tokens < urgent.num_prompt_tokens:
        batch = step(s)
        plans.append(
            {q.request_id: n for q, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}
        )
    assert plans == [{"dec": 1, "urgent": 3 * BS - 1}, {"dec": 1, "urgent": 2 * BS + 1}]
    assert waiting_low.status is SequenceStatus.WAITING  # it came first, it still waits
    batch = step(s)  # both decode (the urgent one first), and the low prompts go on
    ran = {q.request_id: n for q, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}
    assert ran["dec"] == ran["urgent"] == 1 and ran["low0"] > 0
