"""The load a router books for its own decisions, kept in this process.

Every routed request is booked on its replica (the prompt tokens it is predicted to
compute, the KV blocks it will hold), marked prefill-done at its first token and released
when it ends. The same bookings go to Redis (``IndexReader.abook`` ...), where every ingress
replica sees every router's; this local copy is what a router counts on while Redis is
unreachable, and it adds the bookings Redis has not acknowledged yet to Redis' answer, so
a burst never sees stale load. Nothing here does I/O; one event loop uses it.
"""

from __future__ import annotations

from dataclasses import replace

from kvindex.records import Booking, Load


class Bookings:
    """Bookings by request, with the totals per replica kept up to date (a decision reads
    them in O(replicas), however many requests are in flight)."""

    def __init__(self) -> None:
        self._by_request: dict[str, Booking] = {}
        self._totals: dict[str, Load] = {}
        self._unacknowledged: set[str] = set()

    def __len__(self) -> int:
        return len(self._by_request)

    def book(self, booking: Booking) -> None:
        """A request went to its replica (booked again if it was resent elsewhere)."""
        self._remove(booking.request_id)
        self._add(booking, acknowledged=False)

    def acknowledge(self, request_id: str) -> None:
        """Redis took the booking."""
        self._unacknowledged.discard(request_id)

    def prefill_done(self, request_id: str) -> Booking | None:
        """The request's first token came; returns its booking (None if unknown)."""
        acknowledged = request_id not in self._unacknowledged
        booking = self._remove(request_id)
        if booking is not None:
            self._add(replace(booking, prefill_tokens=0), acknowledged)
        return booking

    def release(self, request_id: str, replica_id: str | None = None) -> Booking | None:
        """The request is over (on ``replica_id``, if given); returns what was booked (None
        if nothing was, or it was booked on another replica)."""
        booking = self._by_request.get(request_id)
        if booking is None or (replica_id is not None and booking.replica_id != replica_id):
            return None
        return self._remove(request_id)

    def drop_replica(self, replica_id: str) -> list[str]:
        """A replica is gone: forget its bookings; returns their request ids."""
        gone = [rid for rid, b in self._by_request.items() if b.replica_id == replica_id]
        for rid in gone:
            self._remove(rid)
        return gone

    def totals(self, only_unacknowledged: bool = False) -> dict[str, Load]:
        """Booked load per replica (all of it, or what Redis does not have yet)."""
        if not only_unacknowledged:
            return dict(self._totals)
        totals: dict[str, Load] = {}
        for rid in self._unacknowledged:
            b = self._by_request[rid]
            totals[b.replica_id] = totals.get(b.replica_id, Load()) + _load(b)
        return totals

    def _add(self, booking: Booking, acknowledged: bool) -> None:
        self._by_request[booking.request_id] = booking
        total = self._totals.get(booking.replica_id, Load())
        self._totals[booking.replica_id] = total + _load(booking)
        if not acknowledged:
            self._unacknowledged.add(booking.request_id)

    def _remove(self, request_id: str) -> Booking | None:
        booking = self._by_request.pop(request_id, None)
        if booking is not None:
            self._totals[booking.replica_id] -= _load(booking)
            self._unacknowledged.discard(request_id)
        return booking


def _load(booking: Booking) -> Load:
    return Load(booking.prefill_tokens, in_flight=1, decode_blocks=booking.decode_blocks)
