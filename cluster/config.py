"""Configuration models that users write (in the Serve config's ``args``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from replica.config import EngineConfig


class IndexConfig(BaseModel):
    """Where the Redis block index lives and how long anyone waits for it.

    ``cluster`` and the model id namespace every key, so several clusters (or models) can
    share one Redis. Timeouts are short on purpose: the index is advisory, and a slow Redis
    must never stall an engine step or a routing decision.
    """

    model_config = ConfigDict(extra="forbid")

    url: str = "redis://127.0.0.1:6379/0"
    cluster: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$")
    heartbeat_ttl_s: float = Field(3.0, gt=0)
    heartbeat_interval_s: float = Field(0.5, gt=0)
    timeout_s: float = Field(0.05, gt=0, description="per Redis command")
    connect_timeout_s: float = Field(0.05, gt=0)
    retry_after_s: float = Field(1.0, ge=0, description="pause after a failure before retrying")
    max_pending_hashes: int = Field(
        65_536, gt=0, description="unsent changes kept before falling back to a resync"
    )


class RoutingConfig(BaseModel):
    """Which replica gets a request (``router.policies``; ``ray_*`` are Ray's own routers)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal[
        "cache_aware", "prefix_affinity", "round_robin", "ray_default", "ray_prefix"
    ] = "cache_aware"
    affinity_blocks: int = Field(4, gt=0, description="K: prompt blocks in the affinity key")
    epsilon: float = Field(0.25, gt=0, description="bounded load: at most (1+eps) x mean")
    load_cost_tokens: int = Field(
        256, ge=0, description="cache_aware: cost of one in-flight request, in prompt tokens"
    )
    min_cached_fraction: float = Field(
        0.5, ge=0, le=1, description="cache_aware: below this cached share, route by affinity"
    )
    stats_period_s: float = Field(1.0, gt=0, description="replica stats push period")


class ClusterArgs(BaseModel):
    """The application builder's arguments (``args:`` of ``deploy/config.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = EngineConfig(num_threads=1)
    num_replicas: int = Field(2, gt=0)
    replica_num_cpus: float = Field(0.5, gt=0)
    ingress_num_cpus: float = Field(0.1, gt=0)
    max_ongoing_requests: int = Field(32, gt=0, description="per engine replica")
    max_queued_requests: int = Field(
        64, ge=-1, description="waiting for a replica slot, per ingress; beyond it: 503"
    )
    max_tokens_limit: int = Field(1024, gt=0, description="largest max_tokens accepted")
    routing: RoutingConfig = RoutingConfig()
    index: IndexConfig = IndexConfig()
    api_keys: list[str] = Field(
        default_factory=list, description="if any, required as 'Bearer <key>' (not /health)"
    )
