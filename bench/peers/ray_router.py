"""Ray Serve's default router (power of two choices), timed like ours.

``ray_default`` runs this subclass, so the routing decision time of Ray's own router is
measured at the same place as ``PrefixAwareRequestRouter``'s (``choose_replicas``) and shows
in ``/cluster/stats`` and ``/metrics`` beside it. It changes nothing else.
"""

from __future__ import annotations

import time

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from router import routing_stats


class TimedPowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs: object) -> None:
        super().initialize_state(**kwargs)
        routing_stats.STATE.policy = "ray_default"
        routing_stats.STATE.attach(self)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        start = time.perf_counter()
        ranked = await super().choose_replicas(candidate_replicas, pending_request)
        args = pending_request.args if pending_request is not None else ()
        request_id = getattr(args[0], "request_id", "") if args else ""
        elapsed = time.perf_counter() - start
        routing_stats.STATE.record_decision(request_id, elapsed, "ray_default")
        return ranked
