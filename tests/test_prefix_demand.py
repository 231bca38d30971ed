"""Hot prefixes: each prefix's share of recent requests, and the copy it earns
(``router.prefix_demand``, ``prefill_cost``'s ``hot_half_life_requests``). No Ray, no Redis."""

from __future__ import annotations

import pytest
from conftest import vllm_paths

from kvindex.hashing import BlockHasher
from kvindex.records import ReplicaState, RoutingRequest
from router.config import make_policy, routing_config
from router.prefill_cost import CostKnobs, PrefillCost
from router.prefix_demand import MIN_REQUESTS, PrefixDemand

HASHER = BlockHasher(16, "m")


def prompt(tenant: int, user: int, head_blocks: int = 8) -> RoutingRequest:
    """A tenant's system prompt (``head_blocks`` blocks) and a user's 2 blocks and 5 tokens."""
    head = [(tenant * 7919 + i) % 251 for i in range(head_blocks * 16)]
    tokens = head + [(user * 104729 + i) % 241 for i in range(37)]
    chain = HASHER.chain(tokens)
    return RoutingRequest(
        f"t{tenant}-{user}", chain, HASHER.affinity_key(tokens, 4, chain=chain), len(tokens), 16
    )


def test_a_prefix_share_is_the_decayed_fraction_of_requests_that_carried_it() -> None:
    demand = PrefixDemand(half_life_requests=8)
    hot, cold = prompt(0, 0), prompt(1, 0)
    for i in range(MIN_REQUESTS - 1):
        demand.record((hot if i % 2 else cold).block_hashes)
    assert demand.share(hot.block_hashes[7]) == 0.0  # too few requests to say
    for i in range(30):
        demand.record((hot if i % 2 else cold).block_hashes)
    assert demand.share(hot.block_hashes[7]) == pytest.approx(0.5, abs=0.05)
    for user in range(8):  # one half-life of requests of tenant 1 alone, each a new user
        demand.record(prompt(1, 100 + user).block_hashes)
    assert demand.share(hot.block_hashes[7]) == pytest.approx(0.25, abs=0.03)
    assert demand.share(prompt(1, 100).block_hashes[7]) == pytest.approx(0.75, abs=0.03)
    # a user's own block is theirs alone; a block never seen has no share
    assert demand.share(prompt(1, 107).block_hashes[9]) == pytest.approx(1 / 8 / 1.5, abs=0.06)
    assert demand.share(prompt(5, 0).block_hashes[0]) == 0.0
    demand.check()


def test_rescaling_keeps_shares_and_forgets_what_decayed_away() -> None:
    demand = PrefixDemand(half_life_requests=4)
    old = prompt(9, 0)
    demand.record(old.block_hashes)
    for i in range(200):  # 50 half-lives: several rescales
        demand.record(prompt(i % 2, 0).block_hashes)
        demand.check()
    assert demand.share(prompt(0, 0).block_hashes[3]) == pytest.approx(0.5, abs=0.1)
    assert demand.share(old.block_hashes[3]) == 0.0
    assert len(demand) < 3 * len(old.block_hashes)  # the old prefix's blocks are gone
    with pytest.raises(ValueError):
        PrefixDemand(0)


def hot_policy(**knobs) -> PrefillCost:
    return PrefillCost(CostKnobs(decode_cost_tokens=16, hot_half_life_requests=32, **knobs))


def routed(policy: PrefillCost, tenants: list[int]) -> PrefillCost:
    """``policy`` after routing one request of each of ``tenants`` (new users)."""
    for n, tenant in enumerate(tenants):
        policy.on_routed(prompt(tenant, 1000 + n), "r0", 100, 2)
    return policy


def held(head_blocks: int = 8, **fields: int) -> list[ReplicaState]:
    """r0 holds tenant 0's system prompt, r1 nothing; loads from ``fields``."""
    return [
        ReplicaState("r0", fields.get("r0_in_flight", 0), cached_blocks=head_blocks),
        ReplicaState("r1", fields.get("r1_in_flight", 0), cached_blocks=0),
    ]


def test_a_prefix_more_requests_share_than_one_replica_serves_is_copied_early() -> None:
    req = prompt(0, 1)  # 8 blocks held on r0 of 10: the sticky branch
    # r0 is busier by 2 requests (32 tokens): far within the 768-token sticky budget
    replicas = held(r0_in_flight=3, r1_in_flight=1)
    assert hot_policy().rank(req, replicas)[0] == "r0"  # no demand counted yet: sticky
    plain = PrefillCost(CostKnobs(decode_cost_tokens=16))
    assert routed(plain, [0, 0, 0, 1] * 8).rank(req, replicas)[0] == "r0"  # knob off
    # tenant 0 sends 3 of every 4 requests: share 0.75 x 2 replicas > 1 holder
    policy = routed(hot_policy(), [0, 0, 0, 1] * 8)
    assert policy.rank(req, replicas) == ["r1", "r0"]
    assert policy.explain().startswith("prefill_cost hot: r1")
    # not while the holder is the less loaded, nor when both hold it: the cheapest holder
    assert policy.rank(req, held(r0_in_flight=1, r1_in_flight=3))[0] == "r0"
    both = [ReplicaState("r0", 3, cached_blocks=8), ReplicaState("r1", 1, cached_blocks=8)]
    assert policy.rank(req, both)[0] == "r1" and policy.explain().startswith("prefill_cost sticky")


def test_a_prefix_within_its_holders_share_stays_sticky() -> None:
    req = prompt(0, 1)
    replicas = held(r0_in_flight=3, r1_in_flight=1)
    # tenant 0 sends 2 of every 5 requests: 0.4 x 2 = 0.8 <= 1 holder
    policy = routed(hot_policy(), [0, 0, 1, 2, 3] * 8)
    assert policy.rank(req, replicas)[0] == "r0"
    assert policy.explain().startswith("prefill_cost sticky")
    # the share is the held run's: a chat template's head that everyone shares is not hot
    # for a tenant whose own part is not (here r0 holds only 1 shared block: a new prefix)
    shared = [ReplicaState("r0", 3, cached_blocks=1), ReplicaState("r1", 1, cached_blocks=0)]
    assert policy.rank(prompt(7, 1), shared)[0] == "r1"


def test_the_knob_reaches_the_policy_from_the_routing_section() -> None:
    policy = make_policy(routing_config(hot_half_life_requests=48))
    assert isinstance(policy, PrefillCost) and policy.demand is not None
    off = make_policy(routing_config())
    assert isinstance(off, PrefillCost) and off.demand is None


def test_vllm_engines_copy_hot_prefixes_by_default_ours_do_not() -> None:
    """``engine.backend: vllm`` turns the knob on where the section leaves it unset (the
    drop-in for Ray Serve LLM does the same, ``cluster.ray_llm``); an explicit value stays."""
    from cluster.config import ClusterArgs

    vllm = {"backend": "vllm", "model": str(vllm_paths()[1])}
    off = {"pull": {"enabled": False}, "store": {"enabled": False}}
    assert ClusterArgs(engine=vllm, **off).routing.hot_half_life_requests == 64
    chosen = {"policy": "prefill_cost", "hot_half_life_requests": 0}
    assert ClusterArgs(engine=vllm, routing=chosen, **off).routing.hot_half_life_requests == 0
    assert ClusterArgs().routing.hot_half_life_requests == 0
    other = ClusterArgs(engine=vllm, routing={"policy": "cache_aware"}, **off).routing
    assert other.policy == "cache_aware"
