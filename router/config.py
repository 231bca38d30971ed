"""The routing knobs a user writes (``routing:`` in the Serve config), validated here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PolicyName = Literal["cache_aware", "prefix_affinity", "round_robin", "ray_default", "ray_prefix"]


class RoutingConfig(BaseModel):
    """Which replica gets a request (``router.policies``; ``ray_*`` are Ray's own routers)."""

    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "cache_aware"
    affinity_blocks: int = Field(4, gt=0, description="K: prompt blocks in the affinity key")
    epsilon: float = Field(0.25, gt=0, description="bounded load: at most (1+eps) x mean")
    load_cost_tokens: int = Field(
        256, ge=0, description="cache_aware: cost of one in-flight request, in prompt tokens"
    )
    min_cached_fraction: float = Field(
        0.5, ge=0, le=1, description="cache_aware: below this cached share, route by affinity"
    )
    stats_period_s: float = Field(1.0, gt=0, description="replica stats push period")
