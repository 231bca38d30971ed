"""Our router as a drop-in for Ray Serve LLM (``ray.serve.llm``): one line of its config.

    deployment_config:
      request_router_config:
        request_router_class: cluster.ray_llm:RayLLMPrefixRouter
        request_router_kwargs: {index: {url: redis://HOST:6379/0, cluster: my-llm}}

Ray Serve LLM tokenizes a request in its ingress and hands the prompt's token ids to the
engine deployment's router only when that router is a ``KVAwareRouter`` (its
``is_kv_aware``); it then also turns on each vLLM replica's KV events (ZMQ over TCP, one
port per replica on its node) and advertises where, with vLLM's block size, in the replica's
routing stats (``kv_event_metadata``). This class is such a router, and routes as our
cluster's does (``router.serve.router.PrefixAwareRequestRouter``: the ``prefill_cost``
policy over the Redis index and its mirror):

* the prompt's chain is our hash chain of the token ids Ray's ingress forwarded, at the
  block size the replicas advertise;
* each replica's events feed the index through the same bridge as our own vLLM replicas
  (``replica.vllm``: re-keyed by our chain, gaps replayed), run here, in the router's
  process, one subscriber per replica, published under the replica's Serve id with an epoch
  that is the same in every router process (several ingress replicas publish the same
  entry, not rival ones);
* Dynamo's selection service, which Ray's ingress builds for a ``KVAwareRouter``, is never
  asked (without ``ai-dynamo`` installed it logs a warning and stays idle).

What differs from our own cluster: no ingress of ours reports first tokens, so a request's
prefill counts as load until it finishes; a request with a ``cache_salt`` is hashed without
it (a miss, never a wrong hit); a gap that vLLM's replay buffer no longer covers clears the
replica's entry and its lost chains stay unpublished until they are evicted (this router
cannot reset a replica's cache).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ray.llm._internal.serve.routing_policies.kv_aware.kv_aware_router import KVAwareRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.records import RoutingRequest
from kvindex.writer import IndexWriter
from replica.publisher import IndexPublisher
from replica.vllm.bridge import KVEventBridge
from replica.vllm.events import EventSubscriber
from router.serve.router import PrefixAwareRequestRouter

log = logging.getLogger("ray.serve")
TOKEN_IDS = "request_token_ids"  # Ray's ingress's keyword (kv_aware.constants)
MODEL_ID = "ray-serve-llm"  # roots every chain: the bridges and this router agree on it


class ReplicaFeed:
    """One vLLM replica's KV events into the index, under its Serve replica id."""

    def __init__(self, replica_id: str, meta: dict[str, Any], index: IndexConfig) -> None:
        self.hasher = BlockHasher(int(meta["block_size"]), MODEL_ID)
        self.publisher = IndexPublisher(
            IndexWriter(index, MODEL_ID), replica_id, epoch=f"ray-llm-{replica_id}"
        )
        bridge = KVEventBridge(self.hasher, self.publisher.on_events)
        self.subscriber = EventSubscriber(
            bridge, meta["endpoint"], meta["replay_endpoint"], on_lost=_cannot_reset
        )
        self.publisher.start()
        self.subscriber.start()

    def close(self) -> None:
        self.subscriber.close()
        self.publisher.close(deregister=True)


def _cannot_reset() -> None:
    log.warning("a replica's KV events were lost past its replay buffer: its entry restarts")


class RayLLMPrefixRouter(PrefixAwareRequestRouter, KVAwareRouter):
    """``prefill_cost`` routing for Ray Serve LLM's vLLM replicas (module docstring)."""

    def initialize_state(  # type: ignore[override]
        self, routing: dict[str, Any] | None = None, index: dict[str, Any] | None = None
    ) -> None:
        super().initialize_state(routing=routing, model_id=MODEL_ID, index=index)
        self._feeds: dict[str, ReplicaFeed] = {}
        self._feeds_lock = threading.Lock()
        self._hasher: BlockHasher | None = None
        self._routes: dict[str, RoutingRequest] = {}  # Serve's request id -> its route

    async def rank_candidates(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        self._follow(candidate_replicas)
        return await super().rank_candidates(candidate_replicas, pending_request)

    def _follow(self, replicas: list[RunningReplica]) -> None:
        """A feed for every replica that advertises its events and has none yet."""
        for replica in replicas:
            rid = replica.replica_id.unique_id
            meta = (replica.routing_stats or {}).get("kv_event_metadata")
            if rid in self._feeds or not meta:
                continue
            with self._feeds_lock:
                feed = ReplicaFeed(rid, meta, self.index_config)
                self._feeds[rid] = feed
                self._hasher = self._hasher or feed.hasher

    def routing_request(self, pending_request: PendingRequest | None) -> RoutingRequest | None:
        """The prompt's chain from the token ids Ray's ingress forwarded (computed once per
        request: Serve may rank it again, and reports where it went)."""
        if pending_request is None or self._hasher is None:
            return None
        key = pending_request.metadata.internal_request_id
        route = self._routes.get(key)
        ids = pending_request.kwargs.get(TOKEN_IDS)
        if route is None and ids:
            route = RoutingRequest(
                request_id=pending_request.metadata.request_id or key,
                block_hashes=self._hasher.chain(ids),
                affinity_key=self._hasher.affinity_key(ids, self.config.affinity_blocks),
                num_prompt_tokens=len(ids),
                block_size=self._hasher.block_size,
                max_tokens=_max_tokens(pending_request),
            )
            if len(self._routes) > 100_000:  # requests ranked and never routed (cancelled)
                self._routes.clear()
            self._routes[key] = route
        return route

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        self._routes.pop(pending_request.metadata.internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop_feed(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in [rid for rid in self._feeds if rid not in live]:
            self._drop_feed(rid)

    def _drop_feed(self, rid: str) -> None:
        with self._feeds_lock:
            feed = self._feeds.pop(rid, None)
        if feed is not None:
            feed.close()

    def close(self) -> None:
        for rid in list(self._feeds):
            self._drop_feed(rid)
        super().close()


def _max_tokens(pending: PendingRequest) -> int:
    """The request's output cap, from the routing payload Ray's ingress passes (0: none)."""
    payload = pending.args[0] if pending.args else None
    for field in ("max_completion_tokens", "max_tokens"):
        value = getattr(payload, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0
