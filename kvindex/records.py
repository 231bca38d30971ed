"""The records routers and the index exchange (plain data, no I/O), and the one rule for
reading a chain against holders.

``RoutingRequest`` is what a router may know about a request; ``ReplicaState`` is what it
knows about a replica for that request (the index's answer, with the router's own bookings
added); ``Booking`` is what a router books on the replica it chose.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingRequest:
    """A request as a router sees it: its prompt's block hash chain and sizes, no text."""

    request_id: str
    block_hashes: Sequence[bytes]  # full prompt blocks (kvindex.hashing)
    affinity_key: bytes  # BlockHasher.affinity_key: the first K blocks (or the partial block)
    num_prompt_tokens: int
    block_size: int
    max_tokens: int = 0

    @property
    def usable_tokens(self) -> int:
        """The most prompt tokens a cache can serve: at least one token always runs."""
        return (self.num_prompt_tokens - 1) // self.block_size * self.block_size

    @property
    def decode_blocks(self) -> int:
        """The KV blocks the request holds at most (its prompt and every output token)."""
        return -(-(self.num_prompt_tokens + self.max_tokens) // self.block_size)


@dataclass(frozen=True)
class ReplicaState:
    """A live replica as a router sees it now, for one request.

    Load comes from the routers' bookings (what they sent and has not finished), never from
    polled stats, so it is never a stats period late. ``cached_blocks`` is what the replica
    has published (None: the index did not answer); ``predicted_blocks`` what routers just
    sent there and it will publish soon.
    """

    replica_id: str
    in_flight: int = 0  # requests booked on it and not finished
    booked_prefill_tokens: int = 0  # uncached prompt tokens booked on it, not yet computed
    booked_decode_blocks: int = 0  # KV blocks its booked requests hold or will
    cached_blocks: int | None = None  # leading blocks of the chain it has published
    predicted_blocks: int = 0  # leading blocks recent decisions booked to it (short TTL)
    footprint_blocks: int = 0  # distinct blocks it has published (its share of the cache)
    pullable_blocks: int = 0  # leading blocks another replica has published (kvindex.pulls)

    @property
    def held_blocks(self) -> int:
        """Leading blocks it holds or will hold shortly (published, or predicted)."""
        return max(self.cached_blocks or 0, self.predicted_blocks)


@dataclass(frozen=True)
class Booking:
    """One routed request, as a router books it on its replica."""

    replica_id: str
    request_id: str
    prefill_tokens: int  # the prompt tokens the replica is predicted to compute
    decode_blocks: int  # the KV blocks the request will hold (prompt and output)
    block_hashes: Sequence[bytes]  # its prompt's chain: predicted to be held there soon


def leading_runs(
    chain: Sequence[bytes],
    replica_ids: Iterable[str],
    holders: Callable[[bytes], Collection[str]],
) -> dict[str, int]:
    """How many leading blocks of ``chain`` each replica holds: a replica's run ends at its
    first block it does not hold (the index's query, the simulator's index, a router's
    record of its routes and the peers' models all read a chain this way)."""
    runs = dict.fromkeys(replica_ids, len(chain))
    alive = set(runs)
    for i, block in enumerate(chain):
        if not alive:
            break
        held = holders(block)
        for rid in [r for r in alive if r not in held]:
            runs[rid] = i
            alive.discard(rid)
    return runs
