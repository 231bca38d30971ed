"""The ingress's line to the request router Serve runs in the ingress's own process.

Serve builds the request router itself (from an import path and keyword arguments) and runs
its decisions on an event loop of its own thread, so the ingress cannot be handed a reference
to it. The router attaches itself here when Serve makes it, and records its loop at each
decision (``ServeLinked``); the ingress calls through the link. This is the one
process-wide rendezvous: the router reaches it as ``link.LINK`` (Serve pickles the router's
module by value, so a name imported into it would be a copy).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

from ray.serve import context as serve_context
from ray.serve.request_router import PendingRequest, RunningReplica

from kvindex.records import RoutingRequest
from router.routing_stats import RouteNote


class LinkedRouter(Protocol):
    """What the ingress may ask of its router."""

    loop: asyncio.AbstractEventLoop | None  # where its decisions run (None before the first)

    def prefill_done(self, request_id: str) -> None:
        """A request's first token came (runs on the router's loop)."""

    def route_note(self, request_id: str) -> RouteNote | None:
        """Where a recent request went, why, and what the index said it could reuse."""

    def snapshot(self) -> dict[str, Any]:
        """Routed counts, decision times, index counters, bookings, the replicas' stats."""

    def others_in_flight(self) -> int | None:
        """Requests the other routers have booked and not released (None: unknown)."""

    def engine_replicas(self) -> int | None:
        """The engine replicas Serve runs now (None: none known yet)."""

    def cached_tokens(self, request: RoutingRequest) -> int | None:
        """Prompt tokens of ``request`` the replica holding the most of it has (None:
        unknown)."""

    def close(self) -> None:
        """The ingress is stopping: let go of the index (its shared bookings)."""


class RouterLink:
    def __init__(self) -> None:
        self._router: LinkedRouter | None = None

    def attach(self, router: LinkedRouter) -> None:
        """The router Serve made (the latest one, if the handle was rebuilt)."""
        self._router = router

    def prefill_done(self, request_id: str) -> None:
        """Handed to the router's loop: its bookings and Redis client belong to that loop."""
        router = self._router
        loop = router.loop if router is not None else None
        if router is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(router.prefill_done, request_id)

    def route_note(self, request_id: str) -> RouteNote | None:
        """Read from any thread: a dictionary lookup of a frozen record."""
        router = self._router
        return router.route_note(request_id) if router is not None else None

    def snapshot(self) -> dict[str, Any]:
        router = self._router
        return router.snapshot() if router is not None else {}

    def others_in_flight(self) -> int | None:
        """For the ingress's admission (thread-safe: read from the router's mirror)."""
        router = self._router
        return router.others_in_flight() if router is not None else None

    def engine_replicas(self) -> int | None:
        """For the ingress's admission cap (a length read, safe from any thread)."""
        router = self._router
        return router.engine_replicas() if router is not None else None

    def cached_tokens(self, request: RoutingRequest) -> int | None:
        """For the ingress's fair queue (thread-safe: the router's mirror, under its lock)."""
        router = self._router
        return router.cached_tokens(request) if router is not None else None

    def close(self) -> None:
        router, self._router = self._router, None
        if router is not None:
            router.close()


LINK = RouterLink()


class ServeLinked:
    """What every request router the ingress talks to does, written once: it attaches
    itself to ``LINK`` when Serve makes it (``link()``, from ``initialize_state``), and at
    each decision records the loop its decisions run on, where the ingress's calls into it
    must run. A subclass (listed before Serve's router class) ranks in
    ``rank_candidates``."""

    loop: asyncio.AbstractEventLoop | None = None

    def link(self) -> None:
        self.loop = None
        LINK.attach(self)  # type: ignore[arg-type]  # subclasses are LinkedRouters

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self.loop = asyncio.get_running_loop()
        return await self.rank_candidates(candidate_replicas, pending_request)

    async def rank_candidates(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        raise NotImplementedError


@contextlib.contextmanager
def call_id(call_id: str) -> Iterator[None]:
    """Serve's request context with ``call_id`` as its internal request id, for one call.

    Serve gives every call made while serving an HTTP request that request's internal id, and
    its request router keys pending calls by that id: two calls at once (a batch of prompts)
    would take each other's place and one would never be sent. Each call gets its own.
    """
    current = serve_context._get_serve_request_context()
    own = replace(current, _internal_request_id=call_id)
    token = serve_context._serve_request_context.set(own)
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)
