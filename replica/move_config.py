"""The move settings (``moves:`` in the Serve config): when a replica hands its streams and
hot prefixes to others instead of finishing or losing them (``replica.moves``). Kept apart
from ``replica.moves`` so the cluster's config loads without the engine."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MoveConfig(BaseModel):
    """Streams moved token-exact with their KV: off a replica Serve stops (scale-in,
    redeploy), on an operator's order, and from a busy replica to an idle one."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True,
        description="a replica Serve stops moves its streams and hot prefixes to the others "
        "at once instead of finishing them (false: it drains them, up to drain_timeout_s)",
    )
    push_timeout_s: float = Field(
        5.0, gt=0, description="a stream's KV not taken by then: the next replica recomputes it"
    )
    handoff_blocks: int = Field(
        512, ge=0, description="a leaving replica pushes at most this many cached blocks on"
    )
    handoff_s: float = Field(3.0, ge=0, description="and spends at most this long pushing them")
    balance: bool = Field(
        False,
        description="live migration: a replica with requests waiting moves running decodes "
        "(longest remaining first) to a replica that could run them now, when it pays",
    )
    balance_period_s: float = Field(0.5, gt=0, description="how often a replica looks")
    min_remaining_tokens: int = Field(
        32, ge=1, description="a decode with fewer output tokens left is never moved"
    )
