"""Ray Serve's default router (power of two choices), timed like ours.

The routing experiment runs ``ray_default`` with this subclass (``routing.router_class``),
so the decision time of Ray's own router is measured at the same place as
``PrefixAwareRequestRouter``'s (``choose_replicas``) and shows in ``/cluster/stats`` and
``/metrics`` beside it. It changes nothing else.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from router import routing_stats
from router.serve import link

CLASS_PATH = "bench.peers.ray_router:TimedPowerOfTwoRouter"


class TimedPowerOfTwoRouter(link.ServeLinked, PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs: object) -> None:
        super().initialize_state(**kwargs)
        self.stats = routing_stats.RouterStats("ray_default")
        self.link()

    async def rank_candidates(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        start = time.perf_counter()
        ranked = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas, pending_request
        )
        self.stats.record_decision(time.perf_counter() - start)
        return ranked

    def prefill_done(self, request_id: str) -> None:
        pass  # Ray's router books nothing

    def route_note(self, request_id: str) -> routing_stats.RouteNote | None:
        return None  # it reads no index: no reuse to tell, no reason but its name

    def others_in_flight(self) -> int | None:
        return None  # it shares nothing with other routers

    def engine_replicas(self) -> int | None:
        """The engine replicas Serve runs and routes to now (the admission cap counts
        their slots; None before Serve told)."""
        return len(self.curr_replicas) or None

    def cached_tokens(self, request: Any) -> int | None:
        return None  # it reads no index: the fair queue charges whole prompts

    def close(self) -> None:
        pass  # it holds nothing of the index

    def snapshot(self) -> dict[str, Any]:
        replicas = {
            r.replica_id.unique_id: r.routing_stats or {} for r in self.curr_replicas.values()
        }
        return self.stats.snapshot(replicas)
