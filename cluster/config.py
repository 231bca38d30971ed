"""The application builder's arguments (``args:`` of ``deploy/config.yaml``), validated.

Each part is defined by the package that uses it: ``EngineConfig`` and ``IndexConfig`` by the
replica, ``RoutingConfig`` by the router. This model adds what only the application knows.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from replica.checkpoints import SMOLLM2
from replica.config import EngineConfig
from replica.deployment import ReplicaArgs
from replica.index import IndexConfig
from router.config import RoutingConfig


class ClusterArgs(BaseModel):
    """The application builder's arguments (``args:`` of ``deploy/config.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig(model=SMOLLM2, num_threads=1),
        description="the engine of every replica; the real chat model by default",
    )
    num_replicas: int = Field(2, gt=0)
    replica_num_cpus: float = Field(0.5, gt=0)
    ingress_num_cpus: float = Field(0.1, gt=0)
    ingress_replicas: int = Field(
        1, gt=0, description="ingress replicas; their routers share bookings through Redis"
    )
    max_ongoing_requests: int = Field(32, gt=0, description="per engine replica")
    max_queued_requests: int = Field(
        64, ge=-1, description="waiting for a replica slot, per ingress; beyond it: 503"
    )
    max_tokens_limit: int = Field(1024, gt=0, description="largest max_tokens accepted")
    max_resumes: int = Field(
        2, ge=0, description="times a request is sent again after its replica died"
    )
    routing: RoutingConfig = RoutingConfig()
    index: IndexConfig = IndexConfig()
    api_keys: list[str] = Field(
        default_factory=list, description="if any, required as 'Bearer <key>' (not /health)"
    )

    def replica_args(self) -> ReplicaArgs:
        """What an engine replica needs: its engine and the index it publishes to."""
        return ReplicaArgs(engine=self.engine, index=self.index)
