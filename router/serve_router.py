"""``PrefixAwareRequestRouter``: a Ray Serve ``RequestRouter`` applying a routing policy.

Selected by the engine deployment's ``request_router_config``; Serve runs it inside each
caller's process (the ingress), one instance per handle. It reads the block hash chain that
the ingress put on the request (``EngineRequest``), asks the Redis index (``cache_aware``),
ranks the replicas and returns one rank per replica, so a full first choice spills over to
the second instead of queueing forever.

Load is the larger of this router's own in-flight count and Serve's queue-length cache. The
stats replicas report through ``record_routing_stats`` are exported (``/metrics``,
``/cluster/stats``) but not routed on: they arrive a stats period late.

Serve pickles this module by value: shared state is reached as ``routing_stats.STATE`` only.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from replica.index import BlockIndex, IndexConfig
from router import routing_stats
from router.policies import BoundedLoad, ReplicaLoad, RoutingRequest, make_policy


class PrefixAwareRequestRouter(RequestRouter):
    """Ranks engine replicas with a prefix-aware policy (no FIFO mixin: a choice made for a
    request must serve that request, not whichever request is oldest)."""

    def initialize_state(
        self,
        policy: str = "cache_aware",
        epsilon: float = 0.25,
        load_cost_tokens: int = 256,
        min_cached_fraction: float = 0.5,
        model_id: str = "tiny-llama-6m",
        block_size: int = 16,
        index: dict[str, Any] | None = None,
    ) -> None:
        bound = BoundedLoad(epsilon)
        self.policy = make_policy(policy, bound, load_cost_tokens, min_cached_fraction)
        self.block_size = block_size
        self.index = (
            BlockIndex(IndexConfig.model_validate(index or {}), model_id)
            if policy == "cache_aware"
            else None
        )
        self._in_flight: dict[str, int] = {}
        routing_stats.STATE.policy = policy
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
        loads = [self._load(r) for r in candidate_replicas]
        answer = None
        if self.index is not None:
            answer = await self.index.aquery(request.block_hashes)
            routing_stats.INDEX_ANSWERS.labels("unknown" if answer is None else "answered").inc()
        ranked = self.policy.rank(request, loads, answer)
        routing_stats.STATE.record_decision(time.perf_counter() - start)
        return [[by_id[rid]] for rid in ranked]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        rid = replica_id.unique_id
        self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        self.policy.on_routed(rid)
        routing_stats.STATE.record_routed(rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        rid = replica_id.unique_id
        self._in_flight[rid] = max(0, self._in_flight.get(rid, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id.unique_id, None)

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        rid = replica.replica_id.unique_id
        own = self._in_flight.get(rid, 0)
        cached = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return ReplicaLoad(rid, in_flight=max(own, cached))


def _routing_request(pending: PendingRequest | None, block_size: int) -> RoutingRequest | None:
    if pending is None or not pending.args:
        return None
    req = pending.args[0]
    hashes = getattr(req, "block_hashes", None)
    key = getattr(req, "affinity_key", None)
    tokens = getattr(req, "prompt_token_ids", None)
    if hashes is None or key is None or tokens is None:
        return None
    return RoutingRequest(hashes, key, len(tokens), block_size)
