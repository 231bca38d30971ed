"""The router's own record of what it sent where (its fallback when the index is late)."""

from __future__ import annotations

import pytest

from kvindex.records import ReplicaState, RoutingRequest
from router.prefill_cost import CostKnobs, PrefillCost
from router.recent_routes import RecentRoutes

A, B, C, D = (bytes([i]) * 16 for i in range(4))


def test_held_is_the_leading_run_routed_to_each_replica() -> None:
    recent = RecentRoutes()
    recent.record("r0", [A, B, C], now=0.0)
    recent.record("r1", [A, D], now=0.0)
    assert recent.held([A, B, C, D], now=1.0) == {"r0": 3, "r1": 1}
    assert recent.held([A, D], now=1.0) == {"r0": 1, "r1": 2}
    unknown = bytes([9]) * 16
    assert recent.held([unknown, A], now=1.0) == {}  # the run stops at the first miss
    assert recent.held([], now=1.0) == {}


def test_entries_expire_and_the_least_recently_routed_go_first() -> None:
    recent = RecentRoutes(max_blocks=3, horizon_s=10.0)
    recent.record("r0", [A, B], now=0.0)
    recent.record("r1", [C], now=5.0)
    assert recent.held([A, B], now=9.0) == {"r0": 2}
    assert recent.held([A, B], now=10.0) == {}  # expired at exactly the horizon
    assert recent.held([C], now=10.0) == {"r1": 1}
    recent.record("r1", [D], now=6.0)  # a 4th hash: A, the least recently routed, goes
    assert len(recent) == 3 and recent.held([A, B], now=7.0) == {}  # B is kept, A is not
    recent.forget("r1")
    assert recent.held([C], now=7.0) == {} and recent.held([D], now=7.0) == {}
    with pytest.raises(ValueError):
        RecentRoutes(max_blocks=0)


def test_without_the_index_a_prompt_follows_where_this_router_sent_it() -> None:
    """The policy gets the record as predicted blocks: a tenant's next request goes back to
    the replica its prompt was sent to, not to the least loaded one."""
    recent = RecentRoutes()
    chain = [A, B, C, D]
    recent.record("r1", chain, now=0.0)
    held = recent.held(chain, now=1.0)
    request = RoutingRequest("q", chain, b"key", 70, 16)
    replicas = [
        ReplicaState("r0"),
        ReplicaState("r1", prefill_tokens=40, predicted_blocks=held.get("r1", 0)),
    ]
    policy = PrefillCost(CostKnobs(decode_cost_tokens=0))
    assert policy.rank(request, replicas)[0] == "r1"
    assert policy.explain().startswith("prefill_cost sticky: r1")
