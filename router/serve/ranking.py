"""What Serve's side of routing (``router.serve.router``) reads from a request Serve hands it,
and the ranking it hands back."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RunningReplica

from kvindex.records import RoutingRequest


class Ranked(Sequence[list[RunningReplica]]):
    """A ranking as Serve takes it, one replica per rank, built only as far as Serve reads
    (it tries the ranks in order and stops at the first with room)."""

    def __init__(self, ranking: Sequence[str], by_id: dict[str, RunningReplica]) -> None:
        self.ranking, self.by_id = ranking, by_id

    def __len__(self) -> int:
        return len(self.ranking)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [[self.by_id[rid]] for rid in self.ranking[i]]
        return [self.by_id[self.ranking[i]]]

    def __iter__(self) -> Iterator[list[RunningReplica]]:
        for rid in self.ranking:
            yield [self.by_id[rid]]


def pull_target(pending: PendingRequest | None) -> str | None:
    """The holder a ``PullRequest`` names, or the receiver a ``KVPush`` or ``MoveOrder`` is
    pinned to (None for anything else)."""
    return _named(pending, "target_replica_id")


def routing_request(pending: PendingRequest | None) -> RoutingRequest | None:
    """The ``RoutingRequest`` an ``EngineRequest`` carries (None for anything else)."""
    if pending is None or not pending.args:
        return None
    route = getattr(pending.args[0], "route", None)
    return route if isinstance(route, RoutingRequest) else None


def _named(pending: PendingRequest | None, field: str) -> str | None:
    if pending is None or not pending.args:
        return None
    value = getattr(pending.args[0], field, None)
    return value if isinstance(value, str) else None


def avoided(pending: PendingRequest | None) -> str | None:
    """The replica a ``KVPush`` must not go to: its sender (None for anything else)."""
    return _named(pending, "avoid_replica_id")


def preferred(pending: PendingRequest | None) -> str | None:
    """The replica a moved stream's continuation goes to first: the one its KV was pushed to
    (``EngineRequest.prefer_replica_id``; None for anything else)."""
    return _named(pending, "prefer_replica_id")


def with_preferred(
    ranking: Sequence[list[RunningReplica]], pending: PendingRequest | None
) -> Sequence[list[RunningReplica]]:
    """``ranking`` with the request's preferred replica (``preferred``) moved to the front
    (unchanged without one, or if it is not there)."""
    replica_id = preferred(pending)
    if replica_id is None:
        return ranking
    ranks = [list(rank) for rank in ranking]
    first = [r for rank in ranks for r in rank if r.replica_id.unique_id == replica_id]
    if not first:
        return ranking
    rest = [[r for r in rank if r.replica_id.unique_id != replica_id] for rank in ranks]
    return [first, *[rank for rank in rest if rank]]
