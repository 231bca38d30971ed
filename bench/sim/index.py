"""The Redis index's semantics in memory, for the simulator.

Published blocks come from the simulated engines' cache events, as the publisher feeds
Redis; bookings and predicted blocks come from the routing decisions, as the router books
them, expiring by the simulated clock. ``query`` answers like ``IndexReader.query`` (one
``ReplicaState`` per replica); ``book``, ``prefill_done`` and ``release`` take what the
routing core hands the Redis reader. Nothing is delayed: this index is always in sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvindex.records import Booking, Load, ReplicaState, ReplicaTable, leading_runs
from replica.engine.blocks.prefix_cache import CacheEvents
from router.bookings import Bookings


class SimIndex:
    def __init__(self, predict_ttl_s: float = 5.0) -> None:
        self.predict_ttl_s = predict_ttl_s
        self.holders: dict[bytes, set[str]] = {}
        self.footprint: dict[str, int] = {}
        self.predicted: dict[bytes, dict[str, float]] = {}  # hash -> replica -> expiry
        self.bookings = Bookings()  # what Redis' booking keys and loads hash hold
        self._books = 0

    def listener(self, replica_id: str) -> Callable[[CacheEvents], None]:
        def apply(events: CacheEvents) -> None:
            for h in events.removed:
                held = self.holders.get(h)
                if held is not None and replica_id in held:
                    held.discard(replica_id)
                    self.footprint[replica_id] -= 1
                predicted = self.predicted.get(h)
                if predicted is not None:  # evicted: no longer predicted there (PUBLISH)
                    predicted.pop(replica_id, None)
            for h in events.stored:
                held = self.holders.setdefault(h, set())
                if replica_id not in held:
                    held.add(replica_id)
                    self.footprint[replica_id] = self.footprint.get(replica_id, 0) + 1

        return apply

    def query(self, chain: Sequence[bytes], replica_ids: Sequence[str], now: float) -> ReplicaTable:
        """Every replica's booked load, what it holds of the chain (published and
        predicted) and its footprint: the index's answer, in its one shape."""
        loads = self.bookings.totals()
        published = leading_runs(chain, replica_ids, lambda h: self.holders.get(h, ()))
        predicted = leading_runs(
            chain,
            replica_ids,
            lambda h: {rid for rid, t in self.predicted.get(h, {}).items() if t > now},
        )
        states = []
        for rid in replica_ids:
            load = loads.get(rid, Load())
            states.append(
                ReplicaState(
                    rid,
                    in_flight=load.in_flight,
                    prefill_tokens=load.prefill_tokens,
                    decode_blocks=load.decode_blocks,
                    cached_blocks=published[rid],
                    predicted_blocks=predicted[rid],
                    footprint_blocks=self.footprint.get(rid, 0),
                )
            )
        return ReplicaTable.of(states)

    def book(self, booking: Booking, now: float) -> None:
        """A routing decision: its load, and its chain as predicted-held there."""
        self.bookings.book(booking)
        self.bookings.acknowledge(booking.request_id)
        expiry = now + self.predict_ttl_s
        for h in booking.block_hashes:
            self.predicted.setdefault(h, {})[booking.replica_id] = expiry
        self._books += 1
        if self._books % 1024 == 0:  # forget expired predictions now and then
            self.predicted = {
                h: live
                for h, holders in self.predicted.items()
                if (live := {rid: t for rid, t in holders.items() if t > now})
            }

    def prefill_done(self, request_id: str) -> None:
        self.bookings.prefill_done(request_id)

    def release(self, request_id: str) -> None:
        self.bookings.release(request_id)
