"""Configuration models that users write (in the Serve config's ``args``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
