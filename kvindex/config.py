"""Where the Redis block index lives and how long anyone waits for it (pydantic: users
write it as ``index:`` in the Serve config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class IndexConfig(BaseModel):
    """Where the Redis block index lives and how long anyone waits for it.

    ``cluster`` and the model id namespace every key, so several clusters (or models) can
    share one Redis. Reads on the routing path (``timeout_s``) are bounded: the index is
    advisory, and a slow Redis costs one timeout, then "unknown". A replica's own writes
    (register, publish, heartbeat) run on its publisher thread, off every request's path,
    and wait longer (``write_timeout_s``). Why these numbers: docs/decisions.md.
    """

    model_config = ConfigDict(extra="forbid")

    url: str = "redis://127.0.0.1:6379/0"
    cluster: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$")
    heartbeat_ttl_s: float = Field(3.0, gt=0)
    heartbeat_interval_s: float = Field(0.5, gt=0)
    timeout_s: float = Field(0.25, gt=0, description="per Redis read (routing)")
    write_timeout_s: float = Field(
        1.0, gt=0, description="per replica write (publisher thread: register, publish, beat)"
    )
    connect_timeout_s: float = Field(0.25, gt=0)
    retry_after_s: float = Field(1.0, ge=0, description="pause after a failure before retrying")
    max_pending_hashes: int = Field(
        65_536, gt=0, description="unsent changes kept before falling back to a resync"
    )
    mirror: bool = Field(
        True,
        description="routers keep a live copy of the index (kvindex.mirror) and decide "
        "from it, with no Redis round trip on the request path, and share their bookings "
        "every share_interval_s; off: one query and three booking scripts per request",
    )
    share_interval_s: float = Field(
        0.02, gt=0, description="with mirror: how often a router shares its bookings"
    )
