"""Routing policies as plain Python: no Ray, no Redis."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from bench.sim.peer_policies import DynamoKV, RayPrefixSim, SGLangCacheAware
from kvindex.hashing import BlockHasher
from kvindex.pulls import with_pullable
from kvindex.records import ReplicaState, ReplicaTable, RoutingRequest
from replica.pull_config import PullConfig
from router.config import make_policy, routing_config
from router.core import RoutingCore
from router.policies import (
    BoundedLoad,
    CacheAware,
    PrefixAffinity,
    RoundRobin,
    cheapest,
    cost_order,
    rendezvous_order,
    rendezvous_weights,
)
from router.prefill_cost import CostKnobs, PrefillCost, lead_credit

HASHER = BlockHasher(16, "m")


def request(seed: int, num_blocks: int = 8, extra: int = 5) -> RoutingRequest:
    tokens = [(seed * 7919 + i) % 256 for i in range(num_blocks * 16 + extra)]
    chain = HASHER.chain(tokens)
    return RoutingRequest("", chain, HASHER.affinity_key(tokens, 4, chain=chain), len(tokens), 16)


def weights_first(key: bytes, ids: list[str]) -> str:
    """The replica ``prefill_cost``'s ties go to: the highest ``rendezvous_weights``."""
    return ids[int(rendezvous_weights(key, ids).argmax())]


def loads(*in_flight: int, answer: dict[str, int] | None = None) -> list[ReplicaState]:
    """Replicas r0, r1, ... with these in-flight counts; ``answer``: the index's held blocks
    (None: the index is unknown)."""
    return [
        ReplicaState(f"r{i}", n, cached_blocks=None if answer is None else answer.get(f"r{i}", 0))
        for i, n in enumerate(in_flight)
    ]


def test_rendezvous_moves_about_one_nth_of_keys_when_a_replica_joins_or_leaves() -> None:
    keys = [os.urandom(16) for _ in range(4000)]
    replicas = [f"replica-{i}" for i in range(8)]
    before = {k: rendezvous_order(k, replicas)[0] for k in keys}
    grown = {k: rendezvous_order(k, [*replicas, "replica-8"])[0] for k in keys}
    moved = [k for k in keys if grown[k] != before[k]]
    assert all(grown[k] == "replica-8" for k in moved)  # only to the newcomer
    assert 0.6 / 9 < len(moved) / len(keys) < 1.4 / 9
    shrunk = {k: rendezvous_order(k, replicas[1:])[0] for k in keys}
    moved = [k for k in keys if shrunk[k] != before[k]]
    assert all(before[k] == "replica-0" for k in moved)  # only the leaver's keys
    assert 0.6 / 8 < len(moved) / len(keys) < 1.4 / 8
    # the same key gives the same order in any process and any input order
    assert rendezvous_order(keys[0], replicas) == rendezvous_order(keys[0], replicas[::-1])


def test_cost_order_and_cheapest_are_exactly_the_lexsorts_they_stand_for() -> None:
    """Cheapest first, then highest weight, then position: the one sort of one key, and its
    fallbacks where keys collide or costs span too many bits, give the lexsort's order."""
    high = np.uint64(0xABCD0123) << np.uint64(32)
    # equal costs, weights alike in their high 32 bits: only the low bits order them
    weights = np.array([high | np.uint64(1), high | np.uint64(2), 5], np.uint64)
    assert cost_order(np.array([7, 7, 7]), weights).tolist() == [1, 0, 2]
    rng = np.random.default_rng(0)
    for trial in range(3000):
        n = int(rng.choice([int(rng.integers(0, 200)), 1024, 1500]))
        top = int(rng.choice([2, 50, 2**20, 2**33, 2**45]))  # many ties, some, wide spans
        costs = rng.integers(-3, top, n).astype(np.int64)
        weights = rng.integers(0, 2**64, n, dtype=np.uint64)
        if n > 4 and trial % 3 == 0:
            weights[1] = weights[0]  # equal weights: position decides
            costs[1] = costs[0]
            alike = np.uint64(~((1 << int(rng.integers(0, 40))) - 1) & (2**64 - 1))
            weights[3] = (weights[2] & alike) | np.uint64(trial)  # alike in their high bits
            costs[3] = costs[2]
        expected = np.lexsort((~weights, costs))
        assert cost_order(costs, weights).tolist() == expected.tolist(), trial
        if n:
            assert cheapest(costs, weights) == int(expected[0]), trial


def test_prefix_affinity_keeps_a_shared_prompt_together_and_spreads_distinct_ones() -> None:
    policy = PrefixAffinity()
    same = {policy.rank(request(1, extra=e), loads(0, 0, 0, 0))[0] for e in range(1, 9)}
    assert len(same) == 1  # the first 4 blocks decide; the tails differ
    firsts = [policy.rank(request(s), loads(0, 0, 0, 0))[0] for s in range(64)]
    assert len(set(firsts)) == 4
    # a prompt shorter than a block is placed by its partial block: stable, and spread
    shorts = [
        RoutingRequest("", [], HASHER.affinity_key([i, i + 1, i + 2], 4), 3, 16) for i in range(32)
    ]
    choices = [policy.rank(short, loads(0, 0, 0, 0))[0] for short in shorts]
    assert len(set(choices)) == 4
    # the key is the partial block's content: two short prompts differing in one token (or
    # in salt) get different keys; the same one built afresh, by another hasher, the same
    key = HASHER.affinity_key([1, 2, 3], 4)
    assert HASHER.affinity_key([1, 2, 4], 4) != key
    assert HASHER.affinity_key([1, 2, 3], 4, cache_salt="tenant") != key
    assert BlockHasher(16, "m").affinity_key(list((1, 2, 3)), 4) == key


def test_bounded_load_spills_a_hot_key_to_its_next_choice() -> None:
    policy = PrefixAffinity(BoundedLoad(epsilon=0.25))
    hot = request(3)
    order = policy.rank(hot, loads(0, 0, 0, 0))
    first, second = order[0], order[1]
    in_flight = {r: 0 for r in order}
    placed = []
    for _ in range(40):
        choice = policy.rank(hot, [ReplicaState(r, n) for r, n in in_flight.items()])[0]
        in_flight[choice] += 1
        placed.append(choice)
    assert placed[0] == first
    assert second in placed  # spilled
    mean = 40 / 4
    assert max(in_flight.values()) <= 1.25 * mean + 1
    assert BoundedLoad(0.25).overloaded(loads(10, 0, 0, 0)) == {"r0"}
    assert BoundedLoad(0.25).overloaded(loads(1, 1, 1, 1)) == set()
    assert BoundedLoad(0.25).overloaded(loads(0, 0)) == set()  # an idle cluster takes any


def test_cache_aware_prefers_the_longest_cached_prefix_unless_it_is_overloaded() -> None:
    policy = CacheAware(BoundedLoad(epsilon=0.25), load_cost_tokens=64)
    req = request(5, num_blocks=8)
    answer = {"r0": 2, "r1": 8, "r2": 0, "r3": 5}
    assert policy.rank(req, loads(0, 0, 0, 0, answer=answer))[:2] == ["r1", "r3"]
    # one request in flight on r1 (64 tokens) outweighs its 3 more cached blocks (48)...
    assert policy.rank(req, loads(0, 1, 0, 0, answer=answer))[0] == "r3"
    # ...and over the bounded-load cap it goes last whatever it holds
    assert policy.rank(req, loads(0, 9, 0, 0, answer=answer))[-1] == "r1"


def test_cache_aware_credit_is_capped_so_one_token_always_runs() -> None:
    policy = CacheAware(load_cost_tokens=1)
    req = request(6, num_blocks=4, extra=0)  # 64 tokens: at most 3 blocks can be credited
    states = [ReplicaState("r0", 1, cached_blocks=4), ReplicaState("r1", 0, cached_blocks=3)]
    # equal credit (48 tokens), so load decides, then rendezvous order
    assert policy.rank(req, states)[0] == "r1"


def test_cache_aware_falls_back_to_affinity_when_the_index_is_unknown_or_empty() -> None:
    aware, affinity = CacheAware(), PrefixAffinity()
    for seed in range(10):
        req = request(seed)  # 8 blocks + 5 tokens
        expected = affinity.rank(req, loads(0, 0, 0))
        assert aware.rank(req, loads(0, 0, 0)) == expected
        assert aware.rank(req, loads(0, 0, 0, answer={})) == expected
        # a short shared head (a chat template) is not worth steering for
        assert aware.rank(req, loads(0, 0, 0, answer={"r0": 2, "r1": 2})) == expected


def test_round_robin_cycles_and_every_policy_ranks_every_replica_once() -> None:
    rr = RoundRobin()
    placed = []
    for _ in range(6):
        placed.append(rr.rank(request(0), loads(0, 0, 0))[0])
        assert rr.rank(request(0), loads(0, 0, 0))[0] == placed[-1]  # asking again: same
        rr.on_routed(request(0), placed[-1])
    assert placed == ["r0", "r1", "r2"] * 2
    rr.on_routed(request(0), "r1")  # a spill-over: the turn continues after where it went
    assert rr.rank(request(0), loads(0, 0, 0)) == ["r2", "r0", "r1"]
    ours = [make_policy(routing_config(policy=name)) for name in OUR_POLICIES]
    for policy in [*ours, DynamoKV()]:
        ranked = policy.rank(request(1), loads(3, 0, 1, answer={"r1": 2}))
        assert sorted(ranked) == ["r0", "r1", "r2"]
        assert policy.rank(request(1), []) == []


OUR_POLICIES = ("round_robin", "prefix_affinity", "cache_aware", "prefill_cost")


def cost_policy(**knobs) -> PrefillCost:
    return PrefillCost(CostKnobs(**knobs))


def state(rid: str, **fields) -> ReplicaState:
    return ReplicaState(rid, cached_blocks=fields.pop("cached_blocks", 0), **fields)


def test_prefill_cost_is_prompt_left_plus_booked_prefill_plus_decodes() -> None:
    policy = cost_policy(decode_cost_tokens=10)
    req = request(7, num_blocks=8, extra=5)  # 133 tokens; at most 128 can be cached
    replicas = [
        state("a", cached_blocks=8, in_flight=2, prefill_tokens=100),
        state("b", predicted_blocks=3, in_flight=1),  # booked by a recent decision
        state("c", cached_blocks=2, predicted_blocks=5),  # held = the longer of the two
    ]
    assert policy.costs(req, replicas) == {
        "a": 100 + (133 - 128) + 2 * 10,
        "b": 0 + (133 - 48) + 10,
        "c": 0 + (133 - 80) + 0,
    }


def test_prefill_cost_sticks_to_the_holder_within_its_budget_then_spills() -> None:
    req = request(8, num_blocks=8)  # 133 tokens
    policy = cost_policy(decode_cost_tokens=0, sticky_budget_tokens=200)
    idle = [state("a", cached_blocks=8), state("b"), state("c")]
    assert policy.rank(req, idle)[0] == "a"
    # a is dearer by 128 + 100 - 128 = 100 < 200: it keeps the prompt
    busy = [state("a", cached_blocks=8, prefill_tokens=228), state("b"), state("c")]
    assert policy.rank(req, busy)[0] == "a" and policy.explain().startswith("prefill_cost sticky")
    # dearer by 500 - 128 + 5 - 133 = 244 > 200: it spills to the cheapest, a hot prompt
    # is now booked (predicted) on a second replica
    hot = [
        state("a", cached_blocks=8, prefill_tokens=500),
        state("b"),
        state("c", in_flight=1),
    ]
    ranked = policy.rank(req, hot)
    assert ranked[0] == "b" and policy.explain().startswith("prefill_cost spill")
    assert ranked == ["b", "c", "a"]  # then by cost: every replica, so a full one spills


def worked(policy: PrefillCost, **tokens: int) -> PrefillCost:
    """``policy`` after it routed ``tokens[rid]`` tokens of work to each replica."""
    for rid, n in tokens.items():
        policy.on_routed(request(0), rid, n, len(tokens))
    return policy


def test_a_new_prefix_goes_to_the_least_recent_work_among_the_near_cheapest() -> None:
    req = request(9, num_blocks=4)  # 69 tokens, held nowhere
    policy = worked(cost_policy(decode_cost_tokens=0, new_prefix_slack=1.0), a=500, b=40, c=90)
    replicas = [
        state("a"),
        state("b", prefill_tokens=300),  # did little but too busy now
        state("c", prefill_tokens=40),  # within one prefill
    ]
    assert policy.rank(req, replicas)[0] == "c"
    assert policy.explain().startswith("prefill_cost new prefix: c")
    # a short held head (a chat template's) is no hit: still placed as a new prefix
    replicas[0] = state("a", cached_blocks=1)
    assert policy.rank(req, replicas)[0] == "c"
    replicas[0] = state("a", cached_blocks=2)  # 32 of 64 usable: a hit
    assert policy.rank(req, replicas)[0] == "a"


def test_a_routed_prefix_brings_its_work_so_new_prefixes_spread_by_work_done() -> None:
    """Through the routing core: each request's work (uncached prompt and output) is
    recorded where it went, so idle replicas take new prefixes in turn of work done, not
    of whichever a tie favours (a conversation placed there brings its later turns)."""
    core = RoutingCore(cost_policy(decode_cost_tokens=0))
    idle = ReplicaTable.of([state(r) for r in "abcd"])
    placed = []
    for seed in range(40, 48):
        req = replace(request(seed, num_blocks=4), max_tokens=10)
        decision = core.decide(req, idle)
        placed.append(decision.ranking[0])
        core.routed(decision, decision.ranking[0])
    assert sorted(placed) == sorted("abcd" * 2)  # equal work: each took two
    # b did more (a long prompt): the next two new prefixes go elsewhere
    long = replace(request(50, num_blocks=40), max_tokens=10)
    core.routed(core.decide(long, ReplicaTable.of([state("b"), state("a")])), "b")
    for seed in (60, 61):
        assert core.decide(request(seed, num_blocks=4), idle).ranking[0] != "b"


def test_a_held_template_head_does_not_pull_every_new_prefix_onto_one_replica() -> None:
    """With slack 0, the credit of a held head below the hit threshold (a chat template's
    first blocks) must not decide: idle replicas are equal, and the one that did less wins."""
    req = request(9, num_blocks=4)  # 69 tokens, 64 usable: a hit needs 32 cached
    policy = worked(cost_policy(decode_cost_tokens=0, new_prefix_slack=0.0), a=40, b=1)
    replicas = [state("a", cached_blocks=1), state("b")]
    assert policy.rank(req, replicas)[0] == "b"
    assert policy.explain() == "prefill_cost new prefix: b b=69 a=53"
    # but load still decides first: b busier by one token loses to a
    replicas[1] = state("b", prefill_tokens=1)
    assert policy.rank(req, replicas)[0] == "a"


def test_a_prompt_whose_tail_was_evicted_keeps_its_lead_beyond_a_shared_head() -> None:
    """Under ``min_hit_fraction`` still a new prefix, but the replica keeping more than any
    other, beyond a head another keeps too, is credited its lead (2 blocks: 32 tokens) and
    keeps the prompt unless it is busier by more than that; a lead over replicas keeping
    nothing (a template's first cache) is no credit."""
    req = request(11, num_blocks=8)  # 133 tokens, 128 usable: a hit needs 64 cached
    policy = worked(cost_policy(decode_cost_tokens=0, new_prefix_slack=0.0), a=500, b=1)
    replicas = [state("a", cached_blocks=3), state("b", cached_blocks=1)]
    assert lead_credit(req, ReplicaTable.of(replicas).held).tolist() == [32, 0]
    assert policy.rank(req, replicas)[0] == "a"  # though a did far more recent work
    assert policy.explain() == "prefill_cost new prefix: a a=85 b=117"
    replicas[0] = state("a", cached_blocks=3, prefill_tokens=31)
    assert policy.rank(req, replicas)[0] == "a"  # load 133 + 31 - 32 = 132 < b's 133
    replicas[0] = state("a", cached_blocks=3, prefill_tokens=32)
    assert policy.rank(req, replicas)[0] == "b"  # level: recent work decides, b did less
    # no other replica keeps any of it: the lead is a head's, and earns nothing
    replicas = [state("a", cached_blocks=3), state("b")]
    assert lead_credit(req, ReplicaTable.of(replicas).held).tolist() == [0, 0]
    assert policy.rank(req, replicas)[0] == "b"
    # two keep the most: neither leads
    tied = ReplicaTable.of([state("a", cached_blocks=3), state("b", cached_blocks=3)]).held
    assert lead_credit(req, tied).tolist() == [0, 0]


def test_prefill_cost_ties_follow_the_rendezvous_order_of_the_first_block_nobody_holds() -> None:
    policy = cost_policy()
    for seed in range(20):
        req = request(seed)
        replicas = [state(r) for r in ("a", "b", "c", "d")]  # nothing held: the first block
        assert policy.rank(req, replicas)[0] == weights_first(req.block_hashes[0], list("abcd"))
        held = [state(r, cached_blocks=3) for r in ("a", "b", "c", "d")]  # all hold 3: the 4th
        assert policy.rank(req, held)[0] == weights_first(req.block_hashes[3], list("abcd"))
    whole = request(3)  # every block held: its last block
    held = [state(r, cached_blocks=8) for r in ("a", "b", "c", "d")]
    assert policy.rank(whole, held)[0] == weights_first(whole.block_hashes[-1], list("abcd"))
    short = RoutingRequest("", [], HASHER.affinity_key([1, 2, 3], 4), 3, 16)  # under a block
    assert policy.rank(short, held)[0] == weights_first(short.affinity_key, list("abcd"))


def test_conversations_sharing_a_long_system_prompt_spread_over_idle_replicas() -> None:
    """Every conversation starts with the same 6-block system prompt, which every replica
    holds: the affinity key (4 blocks) is one for all of them, yet the idle replicas must
    share the new conversations, not give every one to the first in that key's order."""
    policy = cost_policy()
    system = [(7919 * i) % 256 for i in range(6 * 16)]
    chosen = []
    for conversation in range(32):
        tokens = system + [(conversation * 31 + i) % 256 for i in range(40)]
        chain = HASHER.chain(tokens)
        req = RoutingRequest(
            "", chain, HASHER.affinity_key(tokens, 4, chain=chain), len(tokens), 16
        )
        replicas = [state(r, cached_blocks=6) for r in ("a", "b", "c", "d")]
        chosen.append(policy.rank(req, replicas)[0])
    assert set(chosen) == set("abcd")
    assert max(chosen.count(r) for r in "abcd") <= 16


def test_ray_prefix_model_follows_its_tree_and_waits_for_its_owner() -> None:
    ray = RayPrefixSim()
    first, follower = request(11, extra=3), request(11, extra=9)
    placed = ray.rank(first, loads(0, 0, 0))  # no match: the smallest tenants (all empty)
    assert placed == ["r0", "r1", "r2"]
    ray.on_routed(first, "r1")
    # the follower matches r1's tree: only r1, however loaded (Ray waits for it)
    assert ray.rank(follower, loads(0, 30, 0)) == ["r1"]
    # a new prompt goes to the replicas with the least text routed to them
    assert ray.rank(request(12), loads(5, 0, 0)) == ["r2", "r0"]
    gated = RayPrefixSim(imbalanced_threshold=10)
    gated.on_routed(first, "r1")
    assert gated.rank(follower, loads(0, 30, 0))[0] == "r0"  # imbalance: least loaded


def test_sglang_model_spills_only_past_both_balance_limits() -> None:
    sglang = SGLangCacheAware()
    req = request(13)
    sglang.on_routed(req, "r2")
    assert sglang.rank(req, loads(10, 10, 12))[0] == "r2"  # over 1.1 x avg, not avg + 32
    assert sglang.rank(req, loads(0, 0, 60))[0] == "r0"  # over both: least loaded
    assert sglang.rank(request(14), loads(3, 1, 2))[0] == "r1"  # a miss: least loaded


def test_dynamo_model_costs_prefill_blocks_after_overlap_plus_decode_blocks() -> None:
    req = request(15, num_blocks=8, extra=0)  # 128 tokens = 8 blocks
    replicas = [
        state("a", cached_blocks=8, decode_blocks=20),  # 0 + 20
        state("b", prefill_tokens=64),  # (64 + 128) / 16 = 12
        state("c", predicted_blocks=6, decode_blocks=5),  # 2 + 5
    ]
    assert DynamoKV().rank(req, replicas) == ["c", "b", "a"]


def test_rendezvous_order_is_the_same_in_every_router_and_release() -> None:
    """Every ingress router ranks alone, so they agree only if the order is a fixed function
    of key and ids: these orders are pinned (a change of hash or digest size would move
    keys between replicas during a rolling upgrade)."""
    assert rendezvous_order(b"\x00" * 16, ["r0", "r1", "r2", "r3"]) == ["r2", "r3", "r0", "r1"]
    assert rendezvous_order(b"key", list("abcde")) == ["b", "a", "d", "c", "e"]


def test_bounded_load_caps_at_the_ceiling_of_the_mean_with_the_new_request() -> None:
    """``in_flight + 1 <= ceil((1 + epsilon) x (total + 1) / n)``, at its exact edges: of two
    replicas, one with 2 in flight would reach 3 > ceil(1.25 x 1.5) = 2; with 1, 2 fits."""
    assert BoundedLoad(0.25).overloaded(loads(2, 0)) == {"r0"}
    assert BoundedLoad(0.25).overloaded(loads(1, 0)) == set()


def test_round_robin_cycles_over_sorted_ids_from_the_first() -> None:
    rr = RoundRobin()
    replicas = [ReplicaState(rid) for rid in ("Z", "A", "Y")]
    assert rr.rank(request(0), replicas) == ["A", "Y", "Z"]


def test_cache_aware_ranks_every_replica_by_uncached_work_load_and_cap() -> None:
    """Exact rankings: a replica holding nothing gets no credit; the load cap puts a replica
    last even when it holds the whole prompt; ties follow rendezvous order."""
    req = request(5, num_blocks=8)  # 133 tokens; affinity order r0, r1, r2, r3
    assert PrefixAffinity().rank(req, loads(0, 0, 0, 0)) == ["r0", "r1", "r2", "r3"]
    policy = CacheAware(BoundedLoad(epsilon=0.25), load_cost_tokens=64)
    answer = {"r0": 0, "r1": 1, "r2": 8, "r3": 0}  # work: 133, 117, 5, 133
    assert policy.rank(req, loads(0, 0, 0, 0, answer=answer)) == ["r2", "r1", "r0", "r3"]
    # cheap load (1 token per request): r1 holds all of it, but 3 in flight is over the cap
    cheap = CacheAware(BoundedLoad(epsilon=0.25), load_cost_tokens=1)
    assert cheap.rank(req, loads(0, 3, 0, 0, answer={"r1": 8})) == ["r0", "r2", "r3", "r1"]


def test_cache_aware_threshold_is_inclusive_and_zero_credit_is_always_affinity() -> None:
    """A cached share of exactly ``min_cached_fraction`` is enough to steer; no credit at all
    is affinity even when the fraction is 0 (then load alone would reorder replicas)."""
    req = request(21, num_blocks=4, extra=0)  # 64 tokens: affinity order r0, r1, r2
    policy = CacheAware(load_cost_tokens=64, min_cached_fraction=0.5)
    assert policy.rank(req, loads(0, 0, 0, answer={"r2": 2})) == ["r2", "r0", "r1"]  # 32 of 64
    req = request(5, num_blocks=8)
    unbounded = BoundedLoad(epsilon=10.0)  # nobody over the cap
    zero = CacheAware(unbounded, load_cost_tokens=64, min_cached_fraction=0.0)
    expected = PrefixAffinity(unbounded).rank(req, loads(0, 1, 0, 0))
    assert expected == ["r0", "r1", "r2", "r3"]
    assert zero.rank(req, loads(0, 1, 0, 0, answer={})) == expected


def test_prefill_cost_serves_a_single_replica_and_measures_against_the_cheapest() -> None:
    req = request(8, num_blocks=8)  # 133 tokens
    policy = cost_policy(decode_cost_tokens=0, sticky_budget_tokens=200)
    assert policy.rank(req, [state("a", cached_blocks=8)]) == ["a"]
    # a costs 400 + 5: 272 over the cheapest (b), within 200 of the second (c, 233)
    replicas = [
        state("a", cached_blocks=8, prefill_tokens=400),
        state("b"),
        state("c", prefill_tokens=100),
    ]
    assert policy.rank(req, replicas) == ["b", "c", "a"]


def test_prefill_cost_edges_of_hit_stickiness_and_slack_are_inclusive() -> None:
    """Each rule at its exact edge, with the explanation in full."""
    req = request(8, num_blocks=8)  # 133 tokens, 128 usable
    policy = cost_policy(decode_cost_tokens=0, sticky_budget_tokens=200)
    # two holders of the whole prompt: the cheaper one is the holder
    twins = [
        state("a", cached_blocks=8, prefill_tokens=100),
        state("b", cached_blocks=8),
        state("c"),
    ]
    assert policy.rank(req, twins) == ["b", "a", "c"]
    # the holder exactly sticky_budget_tokens dearer than the cheapest keeps the prompt
    edge = [state("a", cached_blocks=8, prefill_tokens=328), state("b"), state("c")]
    assert policy.rank(req, edge) == ["a", "b", "c"]
    assert policy.explain() == "prefill_cost sticky: a a=333 b=133 c=133"
    short = request(9, num_blocks=4)  # 69 tokens, 64 usable: a hit needs 32 cached
    slack = worked(cost_policy(decode_cost_tokens=0, new_prefix_slack=1.0), a=500, b=10)
    half = [state("a", cached_blocks=2), state("b")]
    assert slack.rank(short, half)[0] == "a"  # exactly half held: a hit, not a new prefix
    # a new prefix: b, exactly one prefill (69) dearer than a, is near enough, and did less
    near = [state("a"), state("b", prefill_tokens=69)]
    assert slack.rank(short, near)[0] == "b"
    assert slack.explain() == "prefill_cost new prefix: b b=138 a=69"


def test_rendezvous_weights_are_pinned() -> None:
    """Rendezvous weights are a fixed function of key and id, the same in every release."""
    weights = rendezvous_weights(b"key", ["a", "b"]).tolist()
    assert weights == [15587973318394199782, 14061613597486287766]


def test_twin_holders_break_their_tie_in_rendezvous_order_not_list_order() -> None:
    """Equal holders at equal cost tie-break in rendezvous order, never by list order."""
    policy = cost_policy(decode_cost_tokens=0)
    firsts = set()
    for seed in range(8):
        req = request(seed, num_blocks=8)
        first = weights_first(req.block_hashes[-1], ["a", "b"])  # all held: the last block
        firsts.add(first)
        for names in (["a", "b", "c"], ["b", "a", "c"]):
            replicas = [state(n, cached_blocks=8 if n != "c" else 0) for n in names]
            assert policy.rank(req, replicas)[0] == first
    assert firsts == {"a", "b"}  # both list orders were tested against each first


def test_a_new_prefixs_load_leaves_out_what_a_pull_would_save() -> None:
    """A new prefix is placed by load alone, leaving out what a pull would save."""
    req = request(21, num_blocks=16)  # 261 tokens; a's 5 blocks are no hit (80 < 128)
    policy = worked(cost_policy(decode_cost_tokens=0, pull=PullConfig(enabled=True)), a=10, b=100)
    replicas = with_pullable([state("a", cached_blocks=5), state("b")])
    assert policy.costs(req, replicas) == {"a": 261 - 80, "b": 261 - (80 - 31 - 4)}
    assert policy.rank(req, replicas) == ["a", "b"]
    assert policy.explain() == "prefill_cost new prefix: a a=181 b=216"


def test_the_explanation_is_the_name_before_any_decision_and_counts_the_unlisted() -> None:
    """explain() is the name before any ranking, and then counts the replicas it leaves out."""
    policy = cost_policy(decode_cost_tokens=0)
    assert policy.explain() == "prefill_cost"
    replicas = [state(f"r{i}", prefill_tokens=i) for i in range(10)]
    assert policy.rank(request(3), replicas)[:8] == [f"r{i}" for i in range(8)]
    listed = " ".join(f"r{i}={133 + i}" for i in range(8))
    assert policy.explain() == f"prefill_cost new prefix: r0 {listed} (+2 more)"


def test_a_ranking_is_every_replica_by_cost_then_rendezvous_however_it_is_read() -> None:
    """``prefill_cost``'s ranking (read lazily, ``Ranking``) is the choice, then every
    other replica by cost, ties by rendezvous weight: the same list an eager sort gives,
    by index, slice, iteration past the first few, or comparison."""
    policy = cost_policy(sticky_budget_tokens=0)
    rng = __import__("random").Random(5)
    replicas = [
        state(f"r{i}", cached_blocks=rng.choice([0, 0, 2, 8]), in_flight=rng.randrange(3))
        for i in range(40)
    ]
    req = request(3, num_blocks=8)
    ranking = policy.rank(req, replicas)
    costs = policy.costs(req, replicas)
    ids = list(costs)
    key = req.block_hashes[-1]  # the most held is all 8 blocks: ties go by the last
    weights = dict(zip(ids, rendezvous_weights(key, ids).tolist(), strict=True))
    by_cost = sorted(costs, key=lambda rid: (costs[rid], -weights[rid]))
    expected = [ranking[0]] + [rid for rid in by_cost if rid != ranking[0]]
    assert list(ranking) == expected and ranking == expected and expected == ranking
    assert len(ranking) == 40 and ranking[-1] == expected[-1] and ranking[5:9] == expected[5:9]
    assert [rid for rid in ranking] == expected  # iteration past the eager few
    assert ranking != expected[::-1] and ranking != expected[:-1]
