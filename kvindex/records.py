"""What the index answers and what routers book in it (plain records, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaView:
    """What the index says about one live replica, for one prompt's chain."""

    held_blocks: int  # leading blocks of the chain it has published
    predicted_blocks: int  # leading blocks routers recently sent there (not expired)
    footprint_blocks: int  # distinct blocks it has published in all
    booked_prefill_tokens: int  # uncached prompt tokens booked on it, not yet computed
    in_flight: int  # requests booked on it and not released
    booked_decode_blocks: int  # KV blocks its booked requests hold or will


@dataclass(frozen=True)
class Booking:
    """One routed request, as a router books it on its replica."""

    replica_id: str
    request_id: str
    prefill_tokens: int  # the prompt tokens the replica is predicted to compute
    decode_blocks: int  # the KV blocks the request will hold (prompt and output)
    block_hashes: Sequence[bytes]  # its prompt's chain: predicted to be held there soon
