"""``PrefixAwareRequestRouter``: Ray Serve's side of routing, a thin adapter to ``router.core``.

Selected by the engine deployment's ``request_router_config``; Serve runs it inside each
caller's process (the ingress), one instance per handle. For each request it takes the
``RoutingRequest`` the ingress put on the ``EngineRequest``, asks the index what every live
replica holds of it and what is booked there, and lets the routing core rank the replicas;
it returns one rank per replica, so a full first choice spills over to the next instead of
queueing. Every decision is booked in the core and shared with the other ingress replicas'
routers; the ingress reports first tokens through ``router.serve.link``.

With ``index.mirror`` (the default) the index is this router's live copy of it
(``kvindex.mirror``): a decision reads memory, and the bookings go to Redis as one share of
this router's totals every ``share_interval_s`` (``IndexReader.ashare``), which the other
routers' mirrors add up. Without it, or while the copy is not synced, one query per decision
and one booking script per booked change go to Redis. While Redis is unreachable the core
decides with this router's own bookings and recent routes.

Serve pickles this module by value: state shared with the ingress is reached as
``link.LINK`` (module attribute access), never imported by name.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict
from typing import Any

from ray.serve._private.request_router.common import ReplicaQueueLengthCache
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvindex.channel import BookingChannel, QueriedChannel, SharedChannel
from kvindex.config import IndexConfig
from kvindex.pulls import PullPrices
from kvindex.reader import IndexReader
from kvindex.records import RoutingRequest
from kvindex.stored import StorePrices
from router import routing_stats
from router.config import ServedPolicy, make_policy, routing_config
from router.core import RoutingCore
from router.notes import PendingDecision
from router.policies import cache_credits
from router.recent_routes import RecentRoutes
from router.serve import link
from router.serve.queue_lengths import QueueLengths
from router.serve.ranking import Ranked, avoided, pull_target, routing_request, with_preferred

# Serve ids of requests whose completion came before their routing report, kept this long
# (and at most this many): see ``on_request_completed``
EARLY_DONE_S = 30.0
EARLY_DONE_MAX = 4096

log = logging.getLogger("ray.serve")


class PrefixAwareRequestRouter(link.ServeLinked, RequestRouter):
    """Ranks engine replicas with a prefix-aware policy (no FIFO mixin: a choice made for a
    request must serve that request, not whichever request is oldest)."""

    def initialize_state(
        self,
        routing: dict[str, Any] | None = None,
        model_id: str = "tiny-llama-6m",
        index: dict[str, Any] | None = None,
        pull: dict[str, Any] | None = None,
        store: dict[str, Any] | None = None,
    ) -> None:
        self.config: ServedPolicy = routing_config(**(routing or {}))  # type: ignore[assignment]
        cache = getattr(self, "_replica_queue_len_cache", None)
        if type(cache) is ReplicaQueueLengthCache:  # Serve's, readable as a column instead
            self._replica_queue_len_cache = QueueLengths.replacing(cache)
        pulls = PullPrices.model_validate(pull or {})
        stores = StorePrices.model_validate(store or {"enabled": False})
        policy = make_policy(self.config, pulls, stores)
        self.core = RoutingCore(policy, RecentRoutes(), pulls, stores)
        self.index_config = index_config = IndexConfig.model_validate(index or {})
        self.router_id = uuid.uuid4().hex[:12]
        self.channel = _channel(self.core, index_config, model_id, self.router_id, self.config)
        self.index, self.mirror = self.channel.index, self.channel.mirror
        if self.mirror is not None:
            mirror = self.mirror
            routing_stats.MIRROR_SYNCED.set_function(lambda: float(mirror.synced()))
            routing_stats.MIRROR_SYNCED_AT.set_function(lambda: mirror.synced_at or 0.0)
        self.stats = routing_stats.RouterStats(self.config.policy)
        self._last_candidates: list[RunningReplica] | None = None
        self._by_id: dict[str, RunningReplica] = {}
        self._candidate_ids: list[str] = []
        self._decisions: dict[str, PendingDecision] = {}  # request -> its decision, until routed
        self._requests: dict[str, str] = {}  # Serve's internal request id -> ours
        # (Serve's id, replica) -> when Serve reported it completed before it reported it
        # routed (``on_request_completed``)
        self._done_early: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.link()

    async def rank_candidates(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        target = pull_target(pending_request)
        if target is not None:  # a replica pulling a prefix: that holder, or none (it waits)
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        avoid = avoided(pending_request)  # KV pushed by a replica: anywhere but back to it
        if avoid is not None:
            candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id != avoid]
            if not candidate_replicas:
                return []
        request = self.routing_request(pending_request)
        if request is None:  # not an EngineRequest (e.g. a health probe): any replica
            return [candidate_replicas]
        try:
            ranking = await self._ranked(candidate_replicas, request)
            return with_preferred(ranking, pending_request)  # moved: where its KV went, first
        except Exception:  # a defect here must not hang the request: Serve would retry it
            # forever; it goes to any replica, and the defect is logged and counted
            routing_stats.ROUTING_ERRORS.inc()
            self.stats.errors += 1
            n = self.stats.errors
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: seen, without a flood
                log.exception(
                    "routing %s failed (%d so far); any replica serves it", request.request_id, n
                )
            return [candidate_replicas]

    def routing_request(self, pending_request: PendingRequest | None) -> RoutingRequest | None:
        """What this router routes on: the ``RoutingRequest`` our ingress put on the
        ``EngineRequest`` (another front end's router reads its own request here)."""
        return routing_request(pending_request)

    async def _ranked(
        self, candidate_replicas: list[RunningReplica], request: RoutingRequest
    ) -> list[list[RunningReplica]]:
        """``choose_replicas`` for an engine request: the index's answer, the core's
        ranking, the decision kept until Serve says where the request went. The index is
        asked even by a policy that does not read it: the reuse ledger's ``reusable`` is
        its answer (a mirror's costs no round trip)."""
        start, began = time.perf_counter(), time.time()
        by_id, ids = self._candidates(candidate_replicas)
        answer, outcome = await self.channel.answer(request.block_hashes)
        routing_stats.INDEX_ANSWERS.labels(outcome).inc()
        queued = self.replica_queue_len_cache  # as swapped, read as one column (or a test's)
        queued = queued if isinstance(queued, QueueLengths) else None
        nodes = None
        if self.core.stores:  # where each candidate runs: its node's store serves it
            nodes = {rid: r.node_id for rid, r in by_id.items() if r.node_id}
        seen = answer if self.core.policy.uses_index else None
        states = self.core.states(ids, seen, request.block_hashes, queued, nodes)
        decision = self.core.decide(request, states)
        seconds = time.perf_counter() - start
        self.stats.record_decision(seconds)
        reason = self.core.policy.explain()
        pending = PendingDecision(decision, answer, reason, began, seconds, outcome)
        self._decisions[request.request_id] = pending
        if decision.ranking:  # noted now for its first choice (where nearly every request
            # goes), before its first token can reach the ingress; again if it goes elsewhere
            note = pending.note(self.config.policy, decision.ranking[0])
            self.stats.record_note(request.request_id, note)
        return Ranked(decision.ranking, by_id)  # type: ignore[return-value]

    def _candidates(
        self, candidates: list[RunningReplica]
    ) -> tuple[dict[str, RunningReplica], list[str]]:
        """The candidates by id, and their ids: built again only when Serve's list is a new
        one (it replaces the list when its replicas change, never edits it), so the core
        can tell the same candidates from the last decision's without comparing ids."""
        if candidates is not self._last_candidates:
            self._last_candidates = candidates
            self._by_id = {r.replica_id.unique_id: r for r in candidates}
            self._candidate_ids = list(self._by_id)
        return self._by_id, self._candidate_ids

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        rid = replica_id.unique_id
        self.stats.record_routed(rid)
        request = self.routing_request(pending_request)
        if request is None:
            return
        internal = pending_request.metadata.internal_request_id
        if self._done_early.pop((internal, rid), None) is not None:  # over already
            self._decisions.pop(request.request_id, None)
            return
        if self.book(request.request_id, rid):
            self._requests[internal] = request.request_id

    def book(self, request_id: str, replica_id: str) -> bool:
        """Book the request's decision on ``replica_id``, where it went, and note it (False:
        no decision of this router's is waiting for it)."""
        pending = self._decisions.pop(request_id, None)
        if pending is None:
            return False
        if not pending.decision.ranking or pending.decision.ranking[0] != replica_id:
            self.stats.record_note(request_id, pending.note(self.config.policy, replica_id))
        self.channel.booked(self.core.routed(pending.decision, replica_id))
        return True

    def prefill_done(self, request_id: str) -> None:
        """The ingress saw the request's first token: its prompt no longer loads the replica."""
        booking = self.core.prefill_done(request_id)
        if booking is not None:
            self.channel.prefill_done(booking)

    def others_in_flight(self) -> int | None:
        """Requests the other ingress replicas' routers have in the engines, from their
        shares in this router's mirror (None without a synced mirror)."""
        return self.channel.others_in_flight()

    def engine_replicas(self) -> int | None:
        """The engine replicas Serve runs and routes to now (None before it told)."""
        return len(self.curr_replicas) or None

    def cached_tokens(self, request: RoutingRequest) -> int | None:
        """The most of ``request``'s prompt one replica holds, in tokens, by this router's
        mirror of the index (None without a synced mirror: a query would cost a Redis round
        trip on the request's path)."""
        mirror = self.mirror
        if mirror is None or not mirror.synced():
            return None
        table = mirror.query(request.block_hashes)
        if table is None or len(table) == 0:
            return 0 if table is not None else None
        return int(cache_credits(request, table).max())

    def route_note(self, request_id: str) -> routing_stats.RouteNote | None:
        return self.stats.note(request_id)

    def snapshot(self) -> dict[str, Any]:
        replicas = {
            r.replica_id.unique_id: r.routing_stats or {} for r in self.curr_replicas.values()
        }
        return {
            **self.stats.snapshot(replicas),
            "index": asdict(self.index.counters),
            "mirror": asdict(self.mirror.counters) if self.mirror is not None else None,
            "bookings_in_flight": len(self.core.bookings),
        }

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Release the request's booking. Serve reports a completion from the result's done
        callback, scheduled onto this loop from another thread, and a routing from the
        routing task once the replica accepted: a request cancelled as it was accepted (a
        client that went away) can be reported completed first. That completion is kept
        for ``EARLY_DONE_S``, and the routing report that follows books nothing (booked,
        it would hold the replica's load until ``booking_ttl_s``). A rejected attempt is
        reported completed too; if its retry is accepted by the same replica within that
        time, that one request goes unbooked, the lesser error."""
        super().on_request_completed(replica_id, internal_request_id)
        request_id = self._requests.pop(internal_request_id, None)
        if request_id is not None:
            self.release(request_id, replica_id.unique_id)
            return
        now = time.monotonic()
        early = self._done_early
        early[(internal_request_id, replica_id.unique_id)] = now
        while early and (
            len(early) > EARLY_DONE_MAX or next(iter(early.values())) < now - EARLY_DONE_S
        ):
            early.popitem(last=False)

    def release(self, request_id: str, replica_id: str | None = None) -> None:
        """The request is over (on ``replica_id``, if given): its booking goes."""
        booking = self.core.release(request_id, replica_id)
        if booking is not None:
            self.channel.released(booking)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.core.drop_replica(replica_id.unique_id)  # Redis purges it when reaped

    def close(self) -> None:
        """The ingress is stopping: the channel lets go of the index (its shares leave now)."""
        self.channel.close()

    async def share(self) -> int:
        """Share this router's bookings now (a mirror's channel; 0 otherwise)."""
        return await self.channel.share()


def _channel(
    core: RoutingCore, config: IndexConfig, model_id: str, router_id: str, routing: ServedPolicy
) -> BookingChannel:
    """The router's booking channel (``kvindex.channel``): shares over a mirror, or one
    Redis call per decision and booking change."""
    index = IndexReader(config, model_id)
    if not config.mirror:
        return QueriedChannel(
            index, routing.predict_ttl_s, routing.booking_ttl_s, core.acknowledged
        )

    return SharedChannel(
        index, config, model_id, router_id, routing.predict_ttl_s, core.bookings.totals
    )
