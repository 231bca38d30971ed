"""The routing section a user writes (``routing:`` in the Serve config): one tagged section per
policy, each with only its own knobs, and the policy it makes.

``policy`` picks the section: ``prefill_cost`` (the default, ``router.prefill_cost``),
``cache_aware``, ``prefix_affinity`` and ``round_robin`` (ours from before, served by
``PrefixAwareRequestRouter``), or ``ray_default`` / ``ray_prefix`` (Ray Serve's own routers,
which Serve runs itself).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from kvindex.pulls import PullPrices
from kvindex.stored import StorePrices
from router.policies import BoundedLoad, CacheAware, PrefixAffinity, RoundRobin, RoutingPolicy
from router.prefill_cost import STICKY_BUDGET_TOKENS, CostKnobs, PrefillCost
from router.prefix_demand import HALF_LIFE_REQUESTS
from router.recent_work import HALF_LIFE_TOKENS


class _Routing(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stats_period_s: float = Field(1.0, gt=0, description="replica stats push period")


class _OurRouting(_Routing):
    """Knobs every policy of ours shares."""

    predict_ttl_s: float = Field(
        5.0, gt=0, description="how long a routed prompt counts as held before it is published"
    )
    booking_ttl_s: float = Field(
        600.0, gt=0, description="a booking whose release was lost expires after this"
    )
    affinity_blocks: int = Field(4, gt=0, description="K: prompt blocks in the affinity key")


class PrefillCostRouting(_OurRouting):
    policy: Literal["prefill_cost"] = "prefill_cost"
    decode_cost_tokens: int = Field(16, ge=0, description="one running request, in prompt tokens")
    sticky_budget_tokens: int = Field(
        STICKY_BUDGET_TOKENS,
        ge=0,
        description="how much dearer the holder of a prefix may be and keep it",
    )
    new_prefix_slack: float = Field(
        0.0,
        ge=0,
        description="a new prefix may go this many prefills above the cheapest (to the one "
        "that did the least recent work); 0: the cheapest, recent work breaking ties",
    )
    work_half_life_tokens: int = Field(
        HALF_LIFE_TOKENS,
        gt=0,
        description="recent work (what a new prefix's placement balances) halves for every "
        "this many tokens routed per replica",
    )
    min_hit_fraction: float = Field(
        0.5, ge=0, le=1, description="held by no one past this share: a new prefix"
    )
    hot_half_life_requests: int = Field(
        0,
        ge=0,
        description="> 0: a prefix more recent requests share than its holders' part of the "
        "fleet is copied to the least loaded replica; its demand halves every this many "
        "requests (0: off)",
    )


class CacheAwareRouting(_OurRouting):
    policy: Literal["cache_aware"]
    epsilon: float = Field(0.25, gt=0, description="bounded load: at most (1+eps) x mean")
    load_cost_tokens: int = Field(
        256, ge=0, description="cost of one in-flight request, in prompt tokens"
    )
    min_cached_fraction: float = Field(
        0.5, ge=0, le=1, description="below this cached share, route by affinity"
    )


class PrefixAffinityRouting(_OurRouting):
    policy: Literal["prefix_affinity"]
    epsilon: float = Field(0.25, gt=0, description="bounded load: at most (1+eps) x mean")


class RoundRobinRouting(_OurRouting):
    policy: Literal["round_robin"]


class RayRouting(_Routing):
    """Ray Serve's own routers, run by Serve: power of two choices, or its prefix router."""

    policy: Literal["ray_default", "ray_prefix"]
    router_class: str | None = Field(
        None, description="import path of a RequestRouter to use instead (a timed copy)"
    )


ServedPolicy = PrefillCostRouting | CacheAwareRouting | PrefixAffinityRouting | RoundRobinRouting
RoutingConfig = Annotated[ServedPolicy | RayRouting, Field(discriminator="policy")]
SECTIONS: tuple[type[_Routing], ...] = (
    PrefillCostRouting,
    CacheAwareRouting,
    PrefixAffinityRouting,
    RoundRobinRouting,
    RayRouting,
)


def policy_adapter() -> TypeAdapter[Any]:
    """Validates a ``routing:`` section (a dict with ``policy``; prefill_cost if absent)."""
    return TypeAdapter(RoutingConfig)


def routing_config(**fields: Any) -> ServedPolicy | RayRouting:
    """A validated section from keyword fields, e.g. ``routing_config(policy="round_robin")``."""
    return policy_adapter().validate_python({"policy": "prefill_cost", **fields})


def for_vllm(section: ServedPolicy | RayRouting) -> ServedPolicy | RayRouting:
    """``section`` with vLLM engines' defaults where it left them unset: ``prefill_cost``
    copies a hot prefix early (``hot_half_life_requests`` 64). On two vLLM CPU engines that
    halved the hot tenant's TTFT p99; on our engine the simulator showed no gain, so its
    default stays off (README, "Serving vLLM replicas")."""
    if isinstance(section, PrefillCostRouting) and (
        "hot_half_life_requests" not in section.model_fields_set
    ):
        return section.model_copy(update={"hot_half_life_requests": HALF_LIFE_REQUESTS})
    return section


def make_policy(
    config: ServedPolicy, pull: PullPrices | None = None, store: StorePrices | None = None
) -> RoutingPolicy:
    """The policy a section of ours names (``pull`` and ``store``: the replicas' pull and
    store sections, which ``prefill_cost`` prices)."""
    if isinstance(config, PrefillCostRouting):
        knobs = CostKnobs(
            decode_cost_tokens=config.decode_cost_tokens,
            sticky_budget_tokens=config.sticky_budget_tokens,
            new_prefix_slack=config.new_prefix_slack,
            min_hit_fraction=config.min_hit_fraction,
            work_half_life_tokens=config.work_half_life_tokens,
            pull=pull if pull is not None and pull.enabled else None,
            store=store if store is not None and store.enabled else None,
            hot_half_life_requests=config.hot_half_life_requests,
        )
        return PrefillCost(knobs)
    if isinstance(config, CacheAwareRouting):
        bound = BoundedLoad(config.epsilon)
        return CacheAware(bound, config.load_cost_tokens, config.min_cached_fraction)
    if isinstance(config, PrefixAffinityRouting):
        return PrefixAffinity(BoundedLoad(config.epsilon))
    if isinstance(config, RoundRobinRouting):
        return RoundRobin()
    raise ValueError(f"{config.policy} is one of Ray's routers, not a policy of ours")
