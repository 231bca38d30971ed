"""A router's booking channel: how its decisions reach the index and the other routers, and
how it reads the index back. One interface, two ways (``index.mirror``):

* ``QueriedChannel``: every decision queries Redis (``IndexReader.aquery``), and each booking,
  first token and release is one script call (``abook``, ``aprefill_done``, ``arelease``);
  a booking Redis took is acknowledged (``acknowledge``), so the router stops adding it
  itself.
* ``SharedChannel`` (the default): decisions read this router's live copy of the index
  (``kvindex.mirror``; Redis while the copy is not synced), and its bookings go to Redis as
  one share of its totals (``IndexReader.ashare``) when they changed and another router is
  sharing too, and at least every heartbeat interval (others drop a share after
  ``heartbeat_ttl_s``). A router alone has nobody to tell within ``share_interval_s``, and
  sharing 50 times a second costs the ingress's CPU (docs/results.md): it shares every
  heartbeat until another router's shares arrive.

The router (``router.serve.router``) owns the decisions and the bookings themselves
(``router.core``); the channel only carries them, on the router's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvindex.config import IndexConfig
from kvindex.mirror import IndexMirror
from kvindex.reader import IndexReader
from kvindex.records import Booking, Load, ReplicaTable

# this router's booked load per replica (its ``Bookings.totals``)
Totals = Callable[[], Mapping[str, Load]]


class BookingChannel(Protocol):
    index: IndexReader
    mirror: IndexMirror | None

    async def answer(self, chain: Sequence[bytes]) -> tuple[ReplicaTable | None, str]:
        """The index's answer for ``chain`` and where it came from ("mirror", "answered",
        or "unknown" when nothing answered)."""

    def booked(self, booking: Booking) -> None:
        """A request was routed (call on the router's loop)."""

    def prefill_done(self, booking: Booking) -> None: ...

    def released(self, booking: Booking) -> None: ...

    def others_in_flight(self) -> int | None:
        """Requests the other routers have booked (None: this channel cannot tell)."""

    async def share(self) -> int:
        """Share this router's bookings now: the log's sequence number, 0 if none taken."""

    def close(self) -> None: ...


class _Spawner:
    """Fire-and-forget tasks on the running loop, held until done."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[object]] = set()

    def spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class QueriedChannel(_Spawner):
    """One Redis round trip per decision and per booking change (module docstring)."""

    def __init__(
        self,
        index: IndexReader,
        predict_ttl_s: float,
        booking_ttl_s: float,
        acknowledge: Callable[[str], None],
    ) -> None:
        super().__init__()
        self.index, self.mirror = index, None
        self._ttls, self._acknowledge = (predict_ttl_s, booking_ttl_s), acknowledge

    async def answer(self, chain: Sequence[bytes]) -> tuple[ReplicaTable | None, str]:
        answer = await self.index.aquery(chain)
        return answer, "unknown" if answer is None else "answered"

    def booked(self, booking: Booking) -> None:
        self.spawn(self._book(booking))

    async def _book(self, booking: Booking) -> None:
        if await self.index.abook(booking, *self._ttls):
            self._acknowledge(booking.request_id)

    def prefill_done(self, booking: Booking) -> None:
        self.spawn(self.index.aprefill_done(booking.replica_id, booking.request_id))

    def released(self, booking: Booking) -> None:
        self.spawn(self.index.arelease(booking.replica_id, booking.request_id))

    def others_in_flight(self) -> int | None:
        return None

    async def share(self) -> int:
        return 0  # every booking change went to Redis as it happened

    def close(self) -> None:
        pass


class SharedChannel(_Spawner):
    """A mirror to read, shares to write (module docstring)."""

    def __init__(
        self,
        index: IndexReader,
        config: IndexConfig,
        model_id: str,
        router_id: str,
        predict_ttl_s: float,
        totals: Totals,
    ) -> None:
        super().__init__()
        self.index, self.config, self.router_id, self._totals = index, config, router_id, totals
        self._predict_ttl_s = predict_ttl_s
        self.mirror: IndexMirror | None = IndexMirror(config, model_id, router_id=router_id)
        self.mirror.start()
        self._predictions: list[tuple[str, tuple[bytes, ...]]] = []  # routed since the share
        self._due = True
        self._closed = False
        self._loop_task: asyncio.Task[None] | None = None

    async def answer(self, chain: Sequence[bytes]) -> tuple[ReplicaTable | None, str]:
        if self._loop_task is None:  # on the router's loop, from its first decision
            self._loop_task = asyncio.get_running_loop().create_task(self._share_loop())
        assert self.mirror is not None
        answer = self.mirror.query(chain)
        if answer is not None:
            return answer, "mirror"
        answer = await self.index.aquery(chain)  # not synced yet: Redis
        return answer, "unknown" if answer is None else "answered"

    def booked(self, booking: Booking) -> None:
        """Shared at the next share; its prompt predicted held there (as a booking does)."""
        assert self.mirror is not None
        self._predictions.append((booking.replica_id, tuple(booking.block_hashes)))
        self.mirror.predict(booking.replica_id, booking.block_hashes, self._predict_ttl_s)
        self._due = True

    def prefill_done(self, booking: Booking) -> None:
        self.due()

    def released(self, booking: Booking) -> None:
        self.due()

    def due(self) -> None:
        """Share at the next chance (the bookings changed)."""
        self._due = True

    def others_in_flight(self) -> int | None:
        if self.mirror is None or not self.mirror.synced():
            return None
        return self.mirror.state.shared_in_flight

    async def _share_loop(self) -> None:
        """Share when the bookings changed while another router shares too, and at least
        every heartbeat interval; never raises."""
        last = 0.0
        while True:
            await asyncio.sleep(self.config.share_interval_s)
            now = time.monotonic()
            others = self.mirror is not None and bool(self.mirror.state.shares)
            if (self._due and others) or now - last >= self.config.heartbeat_interval_s:
                last = now if await self.share() else last

    async def share(self) -> int:
        """Share this router's bookings now: the log's sequence number, 0 if not taken."""
        if self._closed:
            return 0
        predictions, self._predictions = self._predictions, []
        self._due = False
        return await self.index.ashare(
            self.router_id,
            self.config.heartbeat_ttl_s,
            self._totals(),
            predictions,
            self._predict_ttl_s,
        )

    def close(self) -> None:
        """The mirror's thread ends and this router's shares leave the index now, not a
        heartbeat TTL later (no share after this)."""
        self._closed = True
        if self.mirror is not None:
            self.mirror.stop()
            self.index.unshare(self.router_id)
