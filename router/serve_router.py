"""``PrefixAwareRequestRouter``: a Ray Serve ``RequestRouter`` applying a routing policy.

Selected by the engine deployment's ``request_router_config``; Serve runs it inside each
caller's process (the ingress), one instance per handle. It reads the block hash chain that
the ingress put on the request (``EngineRequest``), asks the Redis index in one round trip
what each live replica holds of it and what is booked there, ranks the replicas and returns
one rank per replica, so a full first choice spills over to the next instead of queueing.

Every decision is booked (``router.bookings``, and in Redis for the other ingress replicas):
the request's predicted prefill tokens and KV blocks on its replica, released at its first
token (the ingress calls ``prefill_done``) and when it ends. While Redis is unreachable the
router decides with its own bookings and no cache knowledge (policies fall back).

Serve pickles this module by value: shared state is reached as ``routing_stats.STATE`` only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvindex.index import BlockIndex, IndexConfig
from kvindex.records import Booking, ReplicaView
from router import routing_stats
from router.bookings import Bookings, Load
from router.config import RoutingConfig, make_policy
from router.policies import ReplicaState, RoutingRequest
from router.recent_routes import RecentRoutes

log = logging.getLogger("ray.serve")


class PrefixAwareRequestRouter(RequestRouter):
    """Ranks engine replicas with a prefix-aware policy (no FIFO mixin: a choice made for a
    request must serve that request, not whichever request is oldest)."""

    def initialize_state(
        self,
        routing: dict[str, Any] | None = None,
        model_id: str = "tiny-llama-6m",
        block_size: int = 16,
        index: dict[str, Any] | None = None,
    ) -> None:
        self.config = RoutingConfig.model_validate(routing or {})
        self.policy = make_policy(self.config)
        self.block_size = block_size
        self.index = BlockIndex(IndexConfig.model_validate(index or {}), model_id)
        self.bookings = Bookings()
        self.recent = RecentRoutes()  # what this router sent where, if Redis does not answer
        self._credits: dict[str, dict[str, int]] = {}  # request -> replica -> credit tokens
        self._requests: dict[str, str] = {}  # Serve's internal request id -> ours
        self._tasks: set[asyncio.Task[Any]] = set()
        routing_stats.STATE.policy = self.config.policy
        routing_stats.STATE.attach(self)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _routing_request(pending_request, self.block_size)
        if request is None:  # not an EngineRequest (e.g. a health probe): any replica
            return [candidate_replicas]
        start = time.perf_counter()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = None
        if self.policy.uses_index:
            views = await self.index.aquery(request.block_hashes)
            routing_stats.INDEX_ANSWERS.labels("unknown" if views is None else "answered").inc()
        states = self._states(candidate_replicas, views, request.block_hashes)
        ranked = self.policy.rank(request, states)
        self._credits[request.request_id] = {
            s.replica_id: min(s.held_blocks * request.block_size, request.usable_tokens)
            for s in states
        }
        routing_stats.STATE.record_decision(
            request.request_id, time.perf_counter() - start, self.policy.explain()
        )
        return [[by_id[rid]] for rid in ranked if rid in by_id]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        rid = replica_id.unique_id
        routing_stats.STATE.record_routed(rid)
        request = _routing_request(pending_request, self.block_size)
        if request is None:
            return
        self.policy.on_routed(request, rid)
        self.recent.record(rid, request.block_hashes)
        self._requests[pending_request.metadata.internal_request_id] = request.request_id
        credit = self._credits.pop(request.request_id, {}).get(rid, 0)
        tokens = pending_request.args[0].prompt_token_ids
        max_tokens = pending_request.args[0].params.max_tokens
        booking = Booking(
            replica_id=rid,
            request_id=request.request_id,
            prefill_tokens=request.num_prompt_tokens - credit,
            decode_blocks=-(-(len(tokens) + max_tokens) // self.block_size),
            block_hashes=request.block_hashes,
        )
        self.bookings.book(booking.request_id, rid, booking.prefill_tokens, booking.decode_blocks)
        self._spawn(self._book(booking))

    def prefill_done(self, request_id: str) -> None:
        """The ingress saw the request's first token: its prompt no longer loads the replica."""
        booking = self.bookings.prefill_done(request_id)
        if booking is not None:
            self._spawn(self.index.aprefill_done(booking.replica_id, request_id))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        request_id = self._requests.pop(internal_request_id, None)
        if request_id is None:
            return
        # a late callback of an attempt the replica rejected must not release the booking
        # of the attempt it accepted
        booking = self.bookings.release(request_id, replica_id.unique_id)
        if booking is not None:
            self._spawn(self.index.arelease(booking.replica_id, request_id))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.bookings.drop_replica(replica_id.unique_id)  # Redis purges it when reaped
        self.recent.forget(replica_id.unique_id)

    def _states(
        self,
        replicas: list[RunningReplica],
        views: dict[str, ReplicaView] | None,
        block_hashes: list[bytes],
    ) -> list[ReplicaState]:
        """What the policy sees: Redis' view (all routers' bookings) plus this router's
        bookings Redis has not acknowledged yet; without Redis' answer, this router's own
        bookings and what it recently routed where (as predicted blocks)."""
        local = self.bookings.totals(only_unacknowledged=views is not None)
        recent = self.recent.held(block_hashes) if views is None else {}
        states = []
        for replica in replicas:
            rid = replica.replica_id.unique_id
            view = views.get(rid) if views is not None else None
            load = local.get(rid, Load())
            if view is not None:
                load += Load(view.booked_prefill_tokens, view.in_flight, view.booked_decode_blocks)
            queued = self.replica_queue_len_cache.get(replica.replica_id) or 0
            states.append(
                ReplicaState(
                    rid,
                    in_flight=max(load.in_flight, queued),
                    booked_prefill_tokens=load.prefill_tokens,
                    booked_decode_blocks=load.decode_blocks,
                    cached_blocks=None if views is None else (view.held_blocks if view else 0),
                    predicted_blocks=view.predicted_blocks if view else recent.get(rid, 0),
                    footprint_blocks=view.footprint_blocks if view else 0,
                )
            )
        return states

    async def _book(self, booking: Booking) -> None:
        cfg = self.config
        if await self.index.abook(booking, cfg.predict_ttl_s, cfg.booking_ttl_s):
            self.bookings.acknowledge(booking.request_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _routing_request(pending: PendingRequest | None, block_size: int) -> RoutingRequest | None:
    if pending is None or not pending.args:
        return None
    req = pending.args[0]
    hashes = getattr(req, "block_hashes", None)
    key = getattr(req, "affinity_key", None)
    tokens = getattr(req, "prompt_token_ids", None)
    if hashes is None or key is None or tokens is None:
        return None
    return RoutingRequest(hashes, key, len(tokens), block_size, req.request_id)
