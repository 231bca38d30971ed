"""Routing policies as plain Python: no Ray, no Redis."""

from __future__ import annotations

import os

from replica.hashing import BlockHasher
from router.policies import (
    BoundedLoad,
    CacheAware,
    PrefixAffinity,
    ReplicaLoad,
    RoundRobin,
    RoutingRequest,
    make_policy,
    rendezvous_order,
)

HASHER = BlockHasher(16, "m")


def request(seed: int, num_blocks: int = 8, extra: int = 5) -> RoutingRequest:
    tokens = [(seed * 7919 + i) % 256 for i in range(num_blocks * 16 + extra)]
    chain = HASHER.chain(tokens)
    return RoutingRequest(chain, HASHER.affinity_key(tokens, 4, chain=chain), len(tokens), 16)


def loads(*in_flight: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", n) for i, n in enumerate(in_flight)]


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


def test_prefix_affinity_keeps_a_shared_prompt_together_and_spreads_distinct_ones() -> None:
    policy = PrefixAffinity()
    same = {policy.rank(request(1, extra=e), loads(0, 0, 0, 0))[0] for e in range(1, 9)}
    assert len(same) == 1  # the first 4 blocks decide; the tails differ
    firsts = [policy.rank(request(s), loads(0, 0, 0, 0))[0] for s in range(64)]
    assert len(set(firsts)) == 4
    short = RoutingRequest([], HASHER.affinity_key([1, 2, 3], 4), 3, 16)
    assert policy.rank(short, loads(0, 0)) == policy.rank(short, loads(0, 0))


def test_bounded_load_spills_a_hot_key_to_its_next_choice() -> None:
    policy = PrefixAffinity(BoundedLoad(epsilon=0.25))
    hot = request(3)
    order = policy.rank(hot, loads(0, 0, 0, 0))
    first, second = order[0], order[1]
    in_flight = {r: 0 for r in order}
    placed = []
    for _ in range(40):
        choice = policy.rank(hot, [ReplicaLoad(r, n) for r, n in in_flight.items()])[0]
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
    assert policy.rank(req, loads(0, 0, 0, 0), answer)[:2] == ["r1", "r3"]
    # one request in flight on r1 (64 tokens) outweighs its 3 more cached blocks (48)...
    assert policy.rank(req, loads(0, 1, 0, 0), answer)[0] == "r3"
    # ...and over the bounded-load cap it goes last whatever it holds
    assert policy.rank(req, loads(0, 9, 0, 0), answer)[-1] == "r1"


def test_cache_aware_credit_is_capped_so_one_token_always_runs() -> None:
    policy = CacheAware(load_cost_tokens=1)
    req = request(6, num_blocks=4, extra=0)  # 64 tokens: at most 3 blocks can be credited
    answer = {"r0": 4, "r1": 3}
    # equal credit (48 tokens), so load decides, then rendezvous order
    assert policy.rank(req, [ReplicaLoad("r0", 1), ReplicaLoad("r1", 0)], answer)[0] == "r1"


def test_cache_aware_falls_back_to_affinity_when_the_index_is_unknown_or_empty() -> None:
    aware, affinity = CacheAware(), PrefixAffinity()
    for seed in range(10):
        req = request(seed)  # 8 blocks + 5 tokens
        expected = affinity.rank(req, loads(0, 0, 0))
        assert aware.rank(req, loads(0, 0, 0), None) == expected
        assert aware.rank(req, loads(0, 0, 0), {"r0": 0, "r1": 0, "r2": 0}) == expected
        # a short shared head (a chat template) is not worth steering for
        assert aware.rank(req, loads(0, 0, 0), {"r0": 2, "r1": 2, "r2": 0}) == expected


def test_round_robin_cycles_and_every_policy_ranks_every_replica_once() -> None:
    rr = RoundRobin()
    placed = []
    for _ in range(6):
        placed.append(rr.rank(request(0), loads(0, 0, 0))[0])
        assert rr.rank(request(0), loads(0, 0, 0))[0] == placed[-1]  # asking again: same
        rr.on_routed(placed[-1])
    assert placed == ["r0", "r1", "r2"] * 2
    rr.on_routed("r1")  # a spill-over: the turn continues after where it really went
    assert rr.rank(request(0), loads(0, 0, 0)) == ["r2", "r0", "r1"]
    for name in ("round_robin", "prefix_affinity", "cache_aware"):
        ranked = make_policy(name).rank(request(1), loads(3, 0, 1), {"r1": 2})
        assert sorted(ranked) == ["r0", "r1", "r2"]
    assert make_policy("cache_aware").rank(request(1), []) == []
