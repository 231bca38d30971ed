"""Readiness, apart from liveness: ``/health`` says the ingress runs; ``/ready`` says the
cluster can serve a request now, for Kubernetes' readiness probe and for anything that waits
for a cluster to start (``make serve``'s message, the tests' and benchmarks' launcher).

Ready means at least one engine replica is up with its model loaded. Serve adds a replica to
its routers' view only once its constructor (which loads the model) has returned, so the
router's count is that number; Ray's own routers report nothing to the ingress, and then the
index's live replicas count instead (a replica registers at the end of its constructor).
The index being unreachable does not make the cluster unready: it serves in a stated
degraded mode (routing from each router's own record of where it sent prefixes, no pulls,
no view of the other ingresses' load), and the answer says so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from cluster.config import ClusterArgs
from kvindex.reader import IndexReader

DEGRADED = (
    "the index is unreachable: each router routes from its own record of where it sent "
    "prefixes (no cache hits seen across routers, no pulls, the admission cap split evenly)"
)


class Readiness(BaseModel):
    """What ``/ready`` answers (200 when ``ready``, else 503 with it as ``readiness``)."""

    ready: bool
    model: str
    engine_replicas: int | None  # up, model loaded (None: cannot tell)
    wanted_replicas: int  # configured (autoscaling: its minimum)
    routed_replicas: int | None  # in this ingress's router's view (None: it reports none)
    indexed_replicas: int | None  # live in the index (None: index unreachable)
    index: str  # "ok" or the degraded mode
    reason: str | None  # why not ready

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def wanted(args: ClusterArgs) -> int:
    return args.autoscaling.min_replicas if args.autoscaling else args.num_replicas


def indexed_replicas(reader: IndexReader) -> int | None:
    """Engine replicas live in the index, or None if it cannot be read."""
    if not reader.ping():
        return None
    try:
        return len(reader.live_replicas())
    except Exception:  # a Redis that answered the ping and then failed: unreachable too
        return None


async def readiness(
    args: ClusterArgs, routed_replicas: Callable[[], int | None], reader: IndexReader
) -> Readiness:
    """The cluster's readiness: ``routed_replicas`` is the router's count (None: a router
    that does not report one), ``reader`` the index (read off the event loop)."""
    indexed = await asyncio.to_thread(indexed_replicas, reader)
    routed = routed_replicas()
    engines = routed if routed is not None else indexed
    reason = None
    if engines is None:
        reason = "cannot tell: the router reports no replicas and the index is unreachable"
    elif engines < 1:
        reason = "no engine replica is up yet (replicas load the model before joining)"
    return Readiness(
        ready=reason is None,
        model=args.engine.model_id,
        engine_replicas=engines,
        wanted_replicas=wanted(args),
        routed_replicas=routed,
        indexed_replicas=indexed,
        index="ok" if indexed is not None else DEGRADED,
        reason=reason,
    )
