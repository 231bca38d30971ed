"""The routing knobs a user writes (``routing:`` in the Serve config), validated here, and
the policy they make."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from bench.sim.peer_policies import DynamoKV, RayPrefixSim, SGLangCacheAware
from router.policies import BoundedLoad, CacheAware, PrefixAffinity, RoundRobin, RoutingPolicy
from router.prefill_cost import CostKnobs, PrefillCost

PolicyName = Literal[
    "prefill_cost",
    "cache_aware",
    "prefix_affinity",
    "round_robin",
    "ray_default",
    "ray_prefix",
    "ray_prefix_sim",
    "sglang_cache_aware",
    "dynamo_kv",
]
RAY_ROUTERS = ("ray_default", "ray_prefix")  # Ray Serve's own routers, not ours


class RoutingConfig(BaseModel):
    """Which replica gets a request. ``prefill_cost`` is the default (``router.prefill_cost``
    explains its rules); ``cache_aware``, ``prefix_affinity`` and ``round_robin`` are ours
    from before; ``ray_*`` are Ray Serve's own routers; ``ray_prefix_sim``,
    ``sglang_cache_aware`` and ``dynamo_kv`` model the peers' rules
    (``bench.sim.peer_policies``)."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "prefill_cost"
    decode_cost_tokens: int = Field(
        16, ge=0, description="prefill_cost: one running request, in prompt tokens"
    )
    sticky_budget_tokens: int = Field(
        512, ge=0, description="prefill_cost: how much dearer the holder may be and keep it"
    )
    new_prefix_slack: float = Field(
        0.0,
        ge=0,
        description="prefill_cost: a new prefix may go this many prefills above the cheapest "
        "(to a smaller cache footprint); 0: the cheapest, footprint breaking ties",
    )
    min_hit_fraction: float = Field(
        0.5, ge=0, le=1, description="prefill_cost: held by no one past this share: new prefix"
    )
    predict_ttl_s: float = Field(
        5.0, gt=0, description="how long a routed prompt counts as held before it is published"
    )
    booking_ttl_s: float = Field(
        600.0, gt=0, description="a booking whose release was lost expires after this"
    )
    affinity_blocks: int = Field(4, gt=0, description="K: prompt blocks in the affinity key")
    epsilon: float = Field(0.25, gt=0, description="bounded load: at most (1+eps) x mean")
    load_cost_tokens: int = Field(
        256, ge=0, description="cache_aware: cost of one in-flight request, in prompt tokens"
    )
    min_cached_fraction: float = Field(
        0.5, ge=0, le=1, description="cache_aware: below this cached share, route by affinity"
    )
    stats_period_s: float = Field(1.0, gt=0, description="replica stats push period")


def make_policy(config: RoutingConfig) -> RoutingPolicy:
    """The policy a config names (not Ray's own routers: Serve runs those itself)."""
    bound = BoundedLoad(config.epsilon)
    knobs = CostKnobs(
        config.decode_cost_tokens,
        config.sticky_budget_tokens,
        config.new_prefix_slack,
        config.min_hit_fraction,
    )
    makers = {
        "prefill_cost": lambda: PrefillCost(knobs),
        "cache_aware": lambda: CacheAware(
            bound, config.load_cost_tokens, config.min_cached_fraction
        ),
        "prefix_affinity": lambda: PrefixAffinity(bound),
        "round_robin": RoundRobin,
        "ray_prefix_sim": RayPrefixSim,
        "sglang_cache_aware": SGLangCacheAware,
        "dynamo_kv": DynamoKV,
    }
    if config.policy not in makers:
        raise ValueError(f"{config.policy} is one of Ray's routers, not a policy of ours")
    return makers[config.policy]()
