"""One routing decision and what a router remembers of it, with no Ray and no I/O in it.

The Serve router (``router.serve_router``) and the simulator (``bench.sim.simulator``) both
own a ``RoutingCore`` and call the same methods in the same order, so the simulator cannot
drift from production:

1. ``states(replica_ids, answer, queued)``: what the policy sees of each replica: the index's
   answer (every router's acknowledged bookings, what each replica holds of the chain),
   plus this router's bookings the index has not acknowledged yet; without an answer, this
   router's own bookings and what it recently routed where (as predicted blocks).
2. ``decide(request, states)``: the policy's ranking, with each replica's cache credit (what
   it holds, plus what it would pull when the replicas pull).
3. ``routed(request, replica_id, decision)``: the ``Booking`` to write to the index, booked
   here too; ``acknowledged`` when the index took it.
4. ``prefill_done`` at the request's first token, ``release`` when it ends, ``drop_replica``
   when a replica dies: each returns what the index must be told.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvindex.pulls import PullConfig, pulled_tokens, with_pullable
from kvindex.records import Booking, ReplicaState, RoutingRequest
from router.bookings import Bookings, Load
from router.policies import RoutingPolicy, cache_credit
from router.recent_routes import RecentRoutes


@dataclass(frozen=True)
class Decision:
    """A ranking (best first) and, per replica, the prompt tokens its cache would serve."""

    request: RoutingRequest
    ranking: list[str]
    credits: dict[str, int]


class RoutingCore:
    """A policy, this router's bookings, (where the index can fail to answer) its record of
    recent routes, and (``pulls``: the replicas pull prefixes) the pull rule: a replica's
    cache credit then includes what it would pull (``kvindex.pulls``)."""

    def __init__(
        self,
        policy: RoutingPolicy,
        recent: RecentRoutes | None = None,
        pulls: PullConfig | None = None,
    ) -> None:
        self.policy = policy
        self.bookings = Bookings()
        self.recent = recent
        self.pulls = pulls if pulls is not None and pulls.enabled else None

    def states(
        self,
        replica_ids: Sequence[str],
        answer: Mapping[str, ReplicaState] | None,
        block_hashes: Sequence[bytes],
        queued: Mapping[str, int] | None = None,
    ) -> list[ReplicaState]:
        """What the policy sees of every candidate (``answer`` None: the index did not
        answer, or the policy does not read it). ``queued``: requests the caller knows to be
        queued at each replica (a floor for its in-flight count)."""
        local = self.bookings.totals(only_unacknowledged=answer is not None)
        recent = {}
        if answer is None and self.recent is not None:
            recent = self.recent.held(block_hashes)
        queued = queued or {}
        states = []
        for rid in replica_ids:
            seen = answer.get(rid) if answer is not None else None
            if seen is not None and rid not in local and queued.get(rid, 0) <= seen.in_flight:
                states.append(seen)  # nothing of this router's to add (most replicas, at scale)
                continue
            base = seen or ReplicaState(rid, cached_blocks=0 if answer is not None else None)
            if answer is None:
                base = replace(base, predicted_blocks=recent.get(rid, 0))
            load = local.get(rid, Load()) + Load(
                base.booked_prefill_tokens, base.in_flight, base.booked_decode_blocks
            )
            states.append(
                replace(
                    base,
                    in_flight=max(load.in_flight, queued.get(rid, 0)),
                    booked_prefill_tokens=load.prefill_tokens,
                    booked_decode_blocks=load.decode_blocks,
                )
            )
        return with_pullable(states) if self.pulls and answer is not None else states

    def decide(self, request: RoutingRequest, states: Sequence[ReplicaState]) -> Decision:
        ranking = self.policy.rank(request, states)
        min_blocks = self.pulls.min_blocks if self.pulls else 0
        credits = {
            s.replica_id: cache_credit(request, s)
            + (pulled_tokens(request, s, min_blocks) if self.pulls else 0)
            for s in states
        }
        return Decision(request, ranking, credits)

    def routed(self, decision: Decision, replica_id: str) -> Booking:
        """The request went to ``replica_id`` (not always the first choice): book it."""
        request = decision.request
        self.policy.on_routed(request, replica_id)
        if self.recent is not None:
            self.recent.record(replica_id, request.block_hashes)
        booking = Booking(
            replica_id=replica_id,
            request_id=request.request_id,
            prefill_tokens=request.num_prompt_tokens - decision.credits.get(replica_id, 0),
            decode_blocks=request.decode_blocks,
            block_hashes=request.block_hashes,
        )
        self.bookings.book(booking)
        return booking

    def acknowledged(self, request_id: str) -> None:
        """The index took the booking (its answers now include it)."""
        self.bookings.acknowledge(request_id)

    def prefill_done(self, request_id: str) -> Booking | None:
        """The request's first token came: its prompt no longer loads the replica."""
        return self.bookings.prefill_done(request_id)

    def release(self, request_id: str, replica_id: str | None = None) -> Booking | None:
        """The request is over (on ``replica_id``: a late callback of an attempt the replica
        rejected must not release the attempt it accepted)."""
        return self.bookings.release(request_id, replica_id)

    def drop_replica(self, replica_id: str) -> None:
        """A replica died: its bookings and what it held are gone."""
        self.bookings.drop_replica(replica_id)
        if self.recent is not None:
            self.recent.forget(replica_id)
