"""Each tenant's share of the cached pool (``replica.engine.blocks.eviction``): exact block
ids on tiny pools, then the engine. A tenant's flood of its own reused prompts evicts its
own blocks first and never the prefix of a tenant under its share (without shares it
does); weights set the shares; one tenant is the plain segmented LRU; accounting checked.
The node store keeps its sets the same way."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_to_end, tiny

from kvindex.hashing import BlockHasher
from replica.engine.blocks.audit import check_block_accounting
from replica.engine.blocks.eviction import EvictionOrder
from replica.engine.blocks.manager import BlockManager
from replica.engine.engine import Engine
from replica.engine.sequence import Sequence
from replica.messages import Owner, RequestOutput, Retention
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams
from replica.store.layout import fingerprint, owner_id
from replica.store.node_store import NodeStore, StoreGeometry
from replica.store.spill_items import published_blocks

BS = 4


def pool(num_blocks: int = 12, shares: bool = True) -> BlockManager:
    hasher = BlockHasher(BS, "test-model")
    return BlockManager(num_blocks, BS, hasher, True, 0.5, 0.5, tenant_shares=shares)


def served(bm: BlockManager, tokens: list[int], rid: str, tenant: str) -> None:
    """Admit, compute the whole prompt and release, as one short request of ``tenant``."""
    seq = Sequence(rid, list(tokens), SamplingParams(), None, arrival_time=0.0)
    seq.tenant = tenant
    n = bm.admit(seq, token_budget=10_000)
    assert n is not None
    seq.num_computed_tokens += n
    bm.release(seq)
    check_block_accounting(bm, [], [])


def test_a_victim_comes_from_the_tenant_over_its_share_whatever_the_segments_say() -> None:
    order = EvictionOrder(max_protected=8)
    order.add(0, "b", protected=False)  # b's one block: the oldest, and on probation
    for block in range(1, 5):
        order.add(block, "a", protected=True)  # a's four, all protected
    order.check()
    assert order.victim() == 1  # b is under its half: a's oldest protected goes first
    assert order.order() == [1, 2, 3, 0, 4]  # at 2 against 1 a is still over; then even
    assert order.held_by() == {"a": 4, "b": 1}


def test_weights_set_the_shares() -> None:
    order = EvictionOrder(max_protected=0)
    order.set_weight("a", 3.0)
    for block in range(3):
        order.add(block, "b", protected=False)
    for block in range(3, 8):
        order.add(block, "a", protected=False)
    # 8 cached, a's share 6: b (3 against a share of 2) is over, a (5) is not
    assert order.victim() == 0
    # then b at 2 of 7 (share 1.75) is still over; at 1 of 6 and of 5 it is under; at
    # 1 of 4 both are at their shares and the older goes
    assert order.order() == [0, 1, 3, 4, 2, 5, 6, 7]
    with pytest.raises(ValueError):
        order.set_weight("a", 0.0)


def test_without_shares_or_with_one_tenant_it_is_the_segmented_lru() -> None:
    for by_tenant, tenants in ((False, ("a", "b")), (True, ("a", "a"))):
        order = EvictionOrder(max_protected=1, by_tenant=by_tenant)
        order.add(0, tenants[0], protected=True)
        order.add(1, tenants[1], protected=False)
        order.add(2, tenants[1], protected=True)  # over the cap: 0 goes back on probation
        order.check()
        assert order.order() == [1, 0, 2]


def test_a_tenants_flood_of_reused_prompts_never_evicts_another_tenants_hit_prefix() -> None:
    """b's prefix is hit (protected). a then serves three prompts of its own twice each
    (hit, protected: with b's, more than the protected segment holds, so b's prefix goes
    back on probation), then three one-off prompts. Without shares those evict b's prefix;
    with shares a, over its share, evicts its own blocks, protected or not."""
    prefix = list(range(1000, 1008))  # b: 2 full blocks
    survived = {}
    for shares in (True, False):
        bm = pool(shares=shares)
        served(bm, [*prefix, 1], "b1", "b")
        served(bm, [*prefix, 2], "b2", "b")  # hit: protected
        for round_ in range(2):
            for p in range(3):
                served(bm, [100 * p + t for t in range(9)], f"a{p}.{round_}", "a")
        for q in range(3):
            served(bm, [5000 + 100 * q + t for t in range(9)], f"once{q}", "a")
        assert bm.prefix_cache is not None
        survived[shares] = len(bm.prefix_cache.lookup(prefix, None))
        if shares:
            held = bm.allocator.cached.held_by()
            assert held["b"] == 2 and held["a"] == bm.allocator.num_cached - 2
    assert survived == {True: 2, False: 0}


def test_a_pins_blocks_count_in_its_tenants_share_once_released() -> None:
    bm = pool()
    seq = Sequence("s1", list(range(9)), SamplingParams(), None, arrival_time=0.0)
    seq.tenant = "a"
    assert bm.admit(seq, token_budget=10_000) is not None
    seq.num_computed_tokens = 9
    seq.retention = Retention("a:s", "b", 30.0)  # the pin's tenant owns them once released
    bm.retain(seq)
    bm.release(seq)
    assert bm.allocator.cached.held_by() == {}  # still pinned: in use
    bm.pins.release_all()
    assert bm.allocator.cached.held_by() == {"b": 2}
    check_block_accounting(bm, [], [])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the dtype served
def test_an_engine_keeps_a_tenants_prefix_through_another_tenants_flood(dtype: str) -> None:
    """12 blocks of 16 (9 may be protected): b's 2-block prefix served twice (hit,
    protected), a's four prompts twice each (their hits overflow the protected segment),
    three one-off prompts of a, then b again. With shares b's prefix is all there (32
    tokens cached); without, a's prompts took its second block. Greedy tokens are the
    same either way; accounting checked after every step."""
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    prefix = [256, *range(1, 32)]
    outs: dict[bool, list[RequestOutput]] = {}
    for shares in (True, False):
        engine = build_engine(
            tiny(num_blocks=12, block_size=16, max_num_seqs=2, dtype=dtype, tenant_kv_shares=shares)
        )
        b, a = Owner("b"), Owner("a")
        outs[shares] = [_run(engine, "b0", [*prefix, 7], greedy, b)]
        outs[shares].append(_run(engine, "b1", [*prefix, 8], greedy, b))
        for round_ in range(2):
            for p in range(4):
                flood = [200 + p, *((11 * t + 5 * p) % 250 for t in range(35))]
                _run(engine, f"a{p}.{round_}", flood, greedy, a)
        for q in range(3):
            once = [100 + q, *((13 * t + 7 * q) % 250 for t in range(35))]
            _run(engine, f"once{q}", once, greedy, a)
        outs[shares].append(_run(engine, "b2", [*prefix, 9], greedy, b))
        engine.check_invariants(idle=True)
    assert outs[True][2].num_cached_tokens == 32
    assert outs[False][2].num_cached_tokens == 16
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]


def _run(
    engine: Engine, rid: str, prompt: list[int], params: SamplingParams, owner: Owner
) -> RequestOutput:
    engine.add_request(rid, prompt, params, owner=owner)
    return run_to_end(engine, rid)


def test_the_node_stores_shares_are_weighted_as_the_pools() -> None:
    """One set of 4 ways, tenants a (weight 1) and b (weight 3). Whichever floods, the set
    ends 1:3: a flood of a, after b's three blocks, replaces only its own one way (unweighted
    it would take b's oldest, for 2:2); a flood of b, after a's two blocks, takes one of them
    and then replaces its own. The weights reach the store from the engine's pool
    (``published_blocks``: the pool's latest weight of the block's tenant)."""
    print_ = fingerprint("m", BS, b"", ("torch.uint8", (8,)))
    a, b = owner_id("a"), owner_id("b")
    keys = [bytes([i]) * 16 for i in range(12)]

    def flood(first: tuple[int, float], then: tuple[int, float], firsts: int) -> list[int]:
        store = NodeStore.anonymous(StoreGeometry(BS, 8, 1, 4), print_)
        for i in range(12):
            owner, weight = first if i < firsts else then
            store.put(keys[i], None, [i] * BS, np.full(8, i, np.uint8), owner=owner, weight=weight)
        store.check()
        return [i for i in range(12) if store.find(keys[i]) is not None]

    assert flood((b, 3.0), (a, 1.0), 3) == [0, 1, 2, 11]  # a keeps to its one way
    assert flood((b, 1.0), (a, 1.0), 3) == [1, 2, 10, 11]  # unweighted: 2:2, b lost its oldest
    assert flood((a, 1.0), (b, 3.0), 2) == [1, 9, 10, 11]  # b takes a's oldest, then its own
    engine = build_engine(tiny(num_blocks=16, block_size=BS))
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    _run(engine, "r", list(range(1, 2 * BS + 1)), once, Owner("b", weight=3.0))
    assert engine.kv is not None
    items = published_blocks(engine.kv, list(range(16)))
    assert [(i.owner, i.weight) for i in items] == [(b, 3.0), (b, 3.0)]


def test_a_tenants_flood_of_the_node_store_replaces_its_own_blocks() -> None:
    """One set of 4 ways: b's two blocks, then a's flood of six. a replaces its own least
    recent block once it holds as many ways as b (counting the new one); b's stay. With
    one owner it is the set's LRU."""
    print_ = fingerprint("m", BS, b"", ("torch.uint8", (8,)))
    a, b = owner_id("a"), owner_id("b")
    assert owner_id("") == 0 and a not in (0, b)
    for owners in ((a, b), (0, 0)):
        store = NodeStore.anonymous(StoreGeometry(BS, 8, 1, 4), print_)
        keys = [bytes([i]) * 16 for i in range(8)]
        for i in range(2):
            store.put(keys[i], None, [i] * BS, np.full(8, i, np.uint8), owner=owners[1])
        for i in range(2, 8):
            store.put(keys[i], None, [i] * BS, np.full(8, i, np.uint8), owner=owners[0])
        held = [i for i in range(8) if store.find(keys[i]) is not None]
        assert held == ([0, 1, 6, 7] if owners[0] else [4, 5, 6, 7])
        store.check()
