"""What a router remembers of a decision once it is made: ``RouteNote`` (where a request
went, why, and what the index said it could reuse there and anywhere: the reuse ledger's
``reusable`` and ``routed``, ``cluster.reuse``), and ``PendingDecision``, a decision
waiting for Serve to say where its request went, which writes the note."""

from __future__ import annotations

from dataclasses import dataclass

from kvindex.records import ReplicaTable
from router.core import Decision
from router.policies import cache_credits


@dataclass(frozen=True)
class RouteNote:
    """One routing decision as the request's trace, ledger and headers tell it.

    ``reusable``: prompt tokens of the longest cached run of the request's blocks on any
    replica or node store, by the index's answer (None: the index did not answer).
    ``routed``: what the replica it went to holds of them (cached, or booked to be) by the
    same answer and this router's bookings. ``credit``: what the router counted that replica
    would not compute (``routed`` plus what it would pull or restore). ``decided_at``: Unix
    time the decision began; ``seconds`` it took; ``index``: where the answer came from."""

    policy: str
    reason: str
    replica: str
    candidates: int
    reusable: int | None
    routed: int
    credit: int
    decided_at: float
    seconds: float
    index: str


@dataclass(frozen=True)
class PendingDecision:
    """A decision waiting for Serve to say where its request went, with what its note
    needs: the index's whole answer (every replica and store), the policy's reason, when
    it began (Unix), how long it took, where the answer came from."""

    decision: Decision
    answer: ReplicaTable | None
    reason: str
    began: float
    seconds: float
    outcome: str

    def note(self, policy: str, replica_id: str) -> RouteNote:
        """The decision as it ended: on ``replica_id`` (not always its first choice)."""
        decision, answer = self.decision, self.answer
        request = decision.request
        routed = decision.held(replica_id)
        reusable = None
        if answer is not None:
            reusable = 0
            if len(answer):
                held = cache_credits(request, answer)
                k = answer.position(replica_id)
                routed = max(routed, int(held[k]) if k is not None else 0)
                reusable = max(int(held.max()), routed)
        return RouteNote(
            policy=policy,
            reason=self.reason,
            replica=replica_id,
            candidates=decision.candidates,
            reusable=reusable,
            routed=routed,
            credit=max(decision.credit(replica_id), routed),
            decided_at=self.began,
            seconds=self.seconds,
            index=self.outcome,
        )
