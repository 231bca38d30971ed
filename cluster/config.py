"""The application builder's arguments (``args:`` of ``deploy/config.yaml``), validated.

Each part is defined by the package that uses it: ``EngineConfig`` by the replica,
``IndexConfig`` by the index, ``RoutingConfig`` (one tagged section per policy) by the router.
This model adds what only the application knows.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.tenants import APIKeyRecord, key_records
from kvindex.config import IndexConfig
from replica.args import ReplicaArgs
from replica.config import EngineConfig
from replica.move_config import MoveConfig
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig
from router.config import PrefillCostRouting, RoutingConfig, for_vllm


class Autoscaling(BaseModel):
    """Ray Serve's ``autoscaling_config`` for the engine deployment (its field names and
    meanings): replicas between ``min_replicas`` and ``max_replicas``, aiming at
    ``target_ongoing_requests`` per replica."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(3, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    metrics_interval_s: float = Field(2.0, gt=0)
    look_back_period_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be at least min_replicas")
        return self


class FairQueueConfig(BaseModel):
    """The ingress's fair queue (``cluster.fair_queue``): with it, the engines take at most
    their slots (replicas x ``max_ongoing_requests``, plus ``express_slots`` lent to a light
    tenant or a higher priority) and the rest wait at the ingress, up to
    ``max_queued_requests``, released by priority, then by weighted fair share of their cost
    after the cache; without it they wait at the ingress in arrival order, behind the
    admission cap."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    deadline_s: float = Field(
        30.0, gt=0, description="the longest a request waits (x-request-timeout may shorten it)"
    )
    express_slots: int = Field(
        1,
        ge=0,
        description="per engine replica, beyond max_ongoing_requests: lent at once to a "
        "tenant under its share or a higher priority when the slots are full (the engine's "
        "max_num_seqs must leave room for them)",
    )
    shared: bool = Field(
        True,
        description="with several ingress replicas, one queue for all of them: the order, the "
        "tenants' shares and the slots kept in Redis (cluster.shared_queue); false: each "
        "ingress orders its own requests over its share of the slots",
    )


class SessionsConfig(BaseModel):
    """Agent sessions (``cluster.sessions``): a request names its session in a header
    (``x-session-id`` and the ones agent clients send) and may ask its blocks kept for the
    session's next turn (``cache_retention: {ttl_s}`` or ``x-cache-retention-s``)."""

    model_config = ConfigDict(extra="forbid")

    max_retention_s: float = Field(
        300.0, ge=0, description="the longest a session's blocks are kept (a key may set less)"
    )
    default_retention_s: float = Field(
        0.0, ge=0, description="kept this long for a request with a session id and no hint"
    )


class ClusterArgs(BaseModel):
    """The application builder's arguments (``args:`` of ``deploy/config.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="the engine of every replica"
    )
    num_replicas: int = Field(2, gt=0, description="engine replicas (without autoscaling)")
    autoscaling: Autoscaling | None = Field(None, description="set: replicas follow the load")
    replica_num_cpus: float = Field(0.5, gt=0)
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources per engine replica"
    )
    max_replicas_per_node: int | None = Field(
        None,
        gt=0,
        description="a hard cap per node (Serve spreads replicas over nodes anyway, softly)",
    )
    drain_timeout_s: float = Field(
        60.0, gt=0, description="a stopping replica finishes its requests for this long"
    )
    ingress_num_cpus: float = Field(0.1, ge=0)
    ingress_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources per ingress replica (e.g. pin it to the head node)",
    )
    ingress_replicas: int = Field(
        1, gt=0, description="ingress replicas; their routers share bookings through Redis"
    )
    max_ongoing_requests: int = Field(32, gt=0, description="per engine replica")
    max_queued_requests: int = Field(
        64, ge=-1, description="waiting for a replica slot, per ingress; beyond it: 503"
    )
    max_tokens_limit: int = Field(1024, gt=0, description="largest max_tokens accepted")
    max_request_bytes: int = Field(
        4 * 2**20, ge=1024, description="request bodies over this: 413, never read whole"
    )
    max_resumes: int = Field(
        2, ge=0, description="times a request is sent again after its replica died"
    )
    routing: RoutingConfig = Field(default_factory=PrefillCostRouting)
    index: IndexConfig = IndexConfig()
    pull: PullConfig = Field(
        default_factory=PullConfig,
        description="a replica pulls prefix blocks another holds instead of recomputing them",
    )
    store: StoreConfig = Field(
        default_factory=StoreConfig,
        description="the second cache tier: evicted blocks kept in a node-shared store",
    )
    moves: MoveConfig = Field(
        default_factory=MoveConfig,
        description="streams and hot prefixes handed on, token-exact, by a replica that "
        "leaves or is too busy",
    )
    api_keys: list[str | APIKeyRecord] = Field(
        default_factory=list,
        description="if any, required as 'Bearer <key>' (not /health, /ready); a record "
        "names the key's tenant, priority, weight and limits (cluster.tenants)",
    )
    fair_queue: FairQueueConfig = Field(
        default_factory=lambda: FairQueueConfig(),
        description="hold requests at the ingress in per-tenant queues instead of Serve's",
    )
    sessions: SessionsConfig = Field(
        default_factory=lambda: SessionsConfig(),
        description="agent sessions: retention of a conversation's blocks between turns",
    )
    share_cache_across_keys: bool = Field(
        False, description="with api_keys: let different keys share cached prefixes"
    )

    @model_validator(mode="after")
    def _keys_once(self) -> ClusterArgs:
        key_records(self.api_keys)  # a key listed twice is refused
        return self

    @model_validator(mode="after")
    def _backend_parts(self) -> ClusterArgs:
        """Pulls and the node store move the native engine's blocks; vLLM's are its own."""
        if self.engine.backend == "vllm" and (self.pull.enabled or self.store.enabled):
            raise ValueError(
                "engine.backend vllm: set pull.enabled and store.enabled to false (pulls and "
                "the node store hold the native engine's KV blocks only)"
            )
        if self.engine.backend == "vllm":
            self.routing = for_vllm(self.routing)
        return self

    @property
    def engine_max_ongoing(self) -> int:
        """What Serve lets each engine replica hold: its slots, and with the fair queue its
        express slots (the ingress keeps the total to the slots and the lent ones)."""
        express = self.fair_queue.express_slots if self.fair_queue.enabled else 0
        return self.max_ongoing_requests + express

    @property
    def max_engine_replicas(self) -> int:
        """Engine replicas there can be at most (the admission cap counts their slots)."""
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    @property
    def affinity_blocks(self) -> int:
        """K of the affinity key the ingress puts on every request (Ray's routers: unused)."""
        return getattr(self.routing, "affinity_blocks", 4)

    def replica_args(self) -> ReplicaArgs:
        """What an engine replica needs: its engine and the index it publishes to."""
        return ReplicaArgs(
            engine=self.engine, index=self.index, pull=self.pull, store=self.store, moves=self.moves
        )
