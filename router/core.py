"""One routing decision and what a router remembers of it, with no Ray and no I/O in it.

The Serve router (``router.serve.router``) and the simulator (``bench.sim.simulator``) both
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
from typing import Protocol

import numpy as np

from kvindex.pulls import PullPrices, pulled_token_column, with_pullable
from kvindex.records import COLUMNS, LOAD_FIELDS, Booking, ReplicaTable, RoutingRequest
from kvindex.stored import StorePrices, stored_token_column, with_stored
from router.bookings import Bookings
from router.policies import RoutingPolicy, cache_credits
from router.recent_routes import RecentRoutes


class QueueFloors(Protocol):
    """Requests known to be queued at replicas (``router.serve.queue_lengths``: Serve's)."""

    def column(self, ids: Sequence[str]) -> np.ndarray:
        """Each of ``ids``' count, in order (0 where none is known)."""
        ...


class Decision:
    """A ranking (best first) and, per replica, the prompt tokens its cache would serve
    (a column of the table ranked, read one replica at a time with ``credit``)."""

    def __init__(
        self,
        request: RoutingRequest,
        ranking: Sequence[str],
        table: ReplicaTable,
        credit: np.ndarray,
    ) -> None:
        self.request, self.ranking = request, ranking
        self._table, self._credit = table, credit

    def credit(self, replica_id: str) -> int:
        k = self._table.position(replica_id)
        return 0 if k is None else int(self._credit[k])

    def held(self, replica_id: str) -> int:
        """Prompt tokens ``replica_id`` holds (cached or predicted) by the table ranked,
        without what it would pull or restore."""
        k = self._table.position(replica_id)
        return 0 if k is None else int(cache_credits(self.request, self._table)[k])

    @property
    def candidates(self) -> int:
        """How many replicas were ranked."""
        return len(self._table)

    @property
    def credits(self) -> dict[str, int]:
        return dict(zip(self._table.ids, self._credit.tolist(), strict=True))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decision):
            return NotImplemented
        same = (self.request, self.ranking) == (other.request, other.ranking)
        return same and self.credits == other.credits

    def __repr__(self) -> str:
        return f"Decision({self.request.request_id!r}, ranking={self.ranking[:8]!r}...)"


class RoutingCore:
    """A policy, this router's bookings, (where the index can fail to answer) its record of
    recent routes, and (``pulls``: the replicas pull prefixes) the pull rule: a replica's
    cache credit then includes what it would pull (``kvindex.pulls``)."""

    def __init__(
        self,
        policy: RoutingPolicy,
        recent: RecentRoutes | None = None,
        pulls: PullPrices | None = None,
        stores: StorePrices | None = None,
    ) -> None:
        self.policy = policy
        self.bookings = Bookings()
        self.recent = recent
        self.pulls = pulls if pulls is not None and pulls.enabled else None
        self.stores = stores if stores is not None and stores.enabled else None
        self._same_lists: tuple[Sequence[str], Sequence[str]] | None = None
        self._same_ids = (0, 0)

    def states(
        self,
        replica_ids: Sequence[str],
        answer: ReplicaTable | None,
        block_hashes: Sequence[bytes],
        queued: QueueFloors | None = None,
        nodes: Mapping[str, str] | None = None,
    ) -> ReplicaTable:
        """What the policy sees of every candidate: the index's ``answer`` for them (None:
        the index did not answer, or the policy does not read it: then nothing is known of
        the caches but what this router recently routed where, as predicted blocks), plus
        this router's bookings the index has not acknowledged (all of them without an
        answer). ``queued``: requests the caller knows to be queued at each replica, a
        floor for its in-flight count (``router.serve.queue_lengths``). ``nodes``: each
        candidate's node, whose store it restores from (``kvindex.stored``). One path for
        every answer: Redis's, a mirror's, the simulator's."""
        if answer is None:
            table = self._unknown(replica_ids, block_hashes)
        else:
            table = self._taken(answer, replica_ids)
        table = self._added(table, queued, only_unacknowledged=answer is not None)
        if self.stores and answer is not None and nodes:
            table = with_stored(table, answer, nodes)
        return with_pullable(table) if self.pulls and answer is not None else table

    def _unknown(self, replica_ids: Sequence[str], block_hashes: Sequence[bytes]) -> ReplicaTable:
        """The candidates with nothing known of their caches (``known`` False) but what this
        router recently routed where (``predicted_blocks``)."""
        columns = {c: np.zeros(len(replica_ids), np.int64) for c in COLUMNS}
        if self.recent is not None:
            recent = self.recent.held(block_hashes)
            predicted = [recent.get(rid, 0) for rid in replica_ids]
            columns["predicted_blocks"] = np.array(predicted, np.int64)
        return ReplicaTable(replica_ids, columns, known=False)

    def _taken(self, table: ReplicaTable, replica_ids: Sequence[str]) -> ReplicaTable:
        """``table.take(replica_ids)``, remembering the last pair of id lists found to be
        one set: Serve passes the same candidate list until its replicas change, a mirror
        the same live list until the live set does (neither list is changed in place), so
        at a thousand replicas most decisions skip comparing a thousand ids."""
        if self._same_ids == (id(replica_ids), id(table.ids)):
            return table
        taken = table.take(replica_ids)
        if taken is table:  # both lists kept alive with their ids, so no id is reused
            self._same_lists = (replica_ids, table.ids)
            self._same_ids = (id(replica_ids), id(table.ids))
        return taken

    def _added(
        self, table: ReplicaTable, queued: QueueFloors | None, only_unacknowledged: bool
    ) -> ReplicaTable:
        """``table`` plus this router's bookings (those the index has not acknowledged, or
        all), with ``queued`` as a floor for in-flight counts (columns touched only where
        needed)."""
        local = self.bookings.totals(only_unacknowledged=only_unacknowledged)
        floors = queued.column(table.ids) if queued is not None else None
        if floors is not None and not floors.any():
            floors = None
        if not local and floors is None:
            return table
        changed = LOAD_FIELDS if local else ()
        columns = {c: table.column(c).copy() for c in changed}
        where = table.positions
        for rid, load in local.items():
            k = where.get(rid)
            if k is not None:
                columns["prefill_tokens"][k] += load.prefill_tokens
                columns["in_flight"][k] += load.in_flight
                columns["decode_blocks"][k] += load.decode_blocks
        if floors is not None:  # a new column, or the copy above raised in place
            in_flight = columns.get("in_flight")
            columns["in_flight"] = np.maximum(table.column("in_flight"), floors, out=in_flight)
        return table.with_columns(**columns)

    def decide(self, request: RoutingRequest, table: ReplicaTable) -> Decision:
        ranking = self.policy.rank(request, table)
        return Decision(request, ranking, table, self.credits(request, table))

    def credits(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        """Prompt tokens each replica will not compute: what it holds, plus the most it
        restores from its node's store or pulls from another replica."""
        credit = cache_credits(request, table)
        if not self.pulls and not self.stores:
            return credit  # never changed in place, like every column
        extra = np.zeros(len(table), np.int64)
        if self.pulls:
            extra = pulled_token_column(request, table, self.pulls.min_blocks)
        if self.stores:
            extra = np.maximum(extra, stored_token_column(request, table))
        return credit + extra

    def routed(self, decision: Decision, replica_id: str) -> Booking:
        """The request went to ``replica_id`` (not always the first choice): book it."""
        request = decision.request
        if self.recent is not None:
            self.recent.record(replica_id, request.block_hashes)
        booking = Booking(
            replica_id=replica_id,
            request_id=request.request_id,
            prefill_tokens=request.num_prompt_tokens - decision.credit(replica_id),
            decode_blocks=request.decode_blocks,
            block_hashes=request.block_hashes,
        )
        work = booking.prefill_tokens + request.max_tokens  # what it will run there
        self.policy.on_routed(request, replica_id, work, decision.candidates)
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
