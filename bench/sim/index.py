"""The Redis index's semantics in memory, for the simulator.

Published blocks come from the simulated engines' cache events, as the publisher feeds
Redis; bookings and predicted blocks come from the routing decisions, as the router books
them (``router.bookings``, the very class the real router keeps locally), expiring by the
simulated clock. ``states`` answers like ``BlockIndex.query``, one ``ReplicaState`` per
replica. Nothing is delayed: the simulated index is always in sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from replica.engine.prefix_cache import CacheEvents
from router.bookings import Bookings, Load
from router.policies import ReplicaState, RoutingRequest


class SimIndex:
    def __init__(self, predict_ttl_s: float = 5.0) -> None:
        self.predict_ttl_s = predict_ttl_s
        self.holders: dict[bytes, set[str]] = {}
        self.footprint: dict[str, int] = {}
        self.predicted: dict[bytes, dict[str, float]] = {}  # hash -> replica -> expiry
        self.bookings = Bookings()
        self._books = 0

    def listener(self, replica_id: str) -> Callable[[CacheEvents], None]:
        def apply(events: CacheEvents) -> None:
            for h in events.removed:
                held = self.holders.get(h)
                if held is not None and replica_id in held:
                    held.discard(replica_id)
                    self.footprint[replica_id] -= 1
            for h in events.stored:
                held = self.holders.setdefault(h, set())
                if replica_id not in held:
                    held.add(replica_id)
                    self.footprint[replica_id] = self.footprint.get(replica_id, 0) + 1

        return apply

    def states(
        self,
        request: RoutingRequest,
        replica_ids: Sequence[str],
        now: float,
        with_cache: bool,
    ) -> list[ReplicaState]:
        """Every replica's booked load, and with ``with_cache`` what it holds of the
        request's chain (published and predicted) and its footprint."""
        loads = self.bookings.totals()
        chain = request.block_hashes
        published = _runs(chain, replica_ids, lambda h: self.holders.get(h, ()))
        predicted = _runs(
            chain,
            replica_ids,
            lambda h: {rid for rid, t in self.predicted.get(h, {}).items() if t > now},
        )
        return [
            ReplicaState(
                rid,
                in_flight=loads.get(rid, Load()).in_flight,
                booked_prefill_tokens=loads.get(rid, Load()).prefill_tokens,
                booked_decode_blocks=loads.get(rid, Load()).decode_blocks,
                cached_blocks=published[rid] if with_cache else None,
                predicted_blocks=predicted[rid] if with_cache else 0,
                footprint_blocks=self.footprint.get(rid, 0),
            )
            for rid in replica_ids
        ]

    def book(
        self, request: RoutingRequest, replica_id: str, credit: int, decode_blocks: int, now: float
    ) -> None:
        """A routing decision: book its load, and its chain as predicted-held there."""
        prefill = request.num_prompt_tokens - credit
        self.bookings.book(request.request_id, replica_id, prefill, decode_blocks)
        expiry = now + self.predict_ttl_s
        for h in request.block_hashes:
            self.predicted.setdefault(h, {})[replica_id] = expiry
        self._books += 1
        if self._books % 1024 == 0:  # forget expired predictions now and then
            self.predicted = {
                h: live
                for h, holders in self.predicted.items()
                if (live := {rid: t for rid, t in holders.items() if t > now})
            }


def _runs(
    chain: Sequence[bytes], replica_ids: Sequence[str], holders: Callable[[bytes], object]
) -> dict[str, int]:
    """How many leading hashes of ``chain`` each replica holds, walking the chain once."""
    runs = dict.fromkeys(replica_ids, len(chain))
    alive = set(replica_ids)
    for i, h in enumerate(chain):
        if not alive:
            break
        held = holders(h)
        for rid in [r for r in alive if r not in held]:
            runs[rid] = i
            alive.discard(rid)
    return runs
