"""Our router as a drop-in for Ray Serve LLM (``ray.serve.llm``): one line of its config.

    deployment_config:
      request_router_config:
        request_router_class: cluster.ray_llm:RayLLMPrefixRouter
        request_router_kwargs: {index: {url: redis://HOST:6379/0, cluster: my-llm}}

Ray Serve LLM tokenizes a request in its ingress and hands the prompt's token ids to the
engine deployment's router only when that router is a ``KVAwareRouter`` (its
``is_kv_aware``), on direct streaming (``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1``,
``RAY_SERVE_ENABLE_HA_PROXY=1``), and only if HAProxy sends the ingress's route call the
request's body (``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1``; without it the router
is handed nothing and routes nothing); it then also turns on each vLLM replica's KV events
(ZMQ over TCP, one port per replica on its node) and advertises where, with vLLM's block
size, in the replica's routing stats (``kv_event_metadata``). This class is such a router,
and routes as our cluster's does (``router.serve.router.PrefixAwareRequestRouter``: the
``prefill_cost`` policy over the Redis index and its mirror, with vLLM engines' defaults:
``router.config.for_vllm``):

* the prompt's chain is our hash chain of the token ids Ray's ingress forwarded (or of a
  completion's prompt the client sent as token ids, which Ray's ingress does not
  tokenize), at the block size the replicas advertise;
* each replica's events feed the index through the same bridge as our own vLLM replicas
  (``replica.vllm``: re-keyed by our chain, gaps replayed), run here, in the router's
  process, one subscriber per replica, published under the replica's Serve id with an epoch
  that is the same in every router process (several ingress replicas publish the same
  entry, not rival ones);
* Dynamo's selection service, which Ray's ingress builds for a ``KVAwareRouter``, is never
  asked (without ``ai-dynamo`` installed it logs a warning and stays idle).

* on this path Serve never reports a request routed or ended to its router (Ray's ingress
  picks with ``choose_replica(_reserve=False)`` and sends through HAProxy), so a request is
  booked on its first choice as it is ranked, and its prefill and its booking end with the
  lifecycle events every replica reports to the ingress (``cluster.ray_llm_events``); a
  booking whose end was lost (the reports are best-effort) expires after
  ``routing.booking_ttl_s``.

Ray's app names no replica for a request anywhere (no response header, no access-log
field), so this router logs each decision at INFO in the ingress replica's log:
``routed <request id> to <replica>: <policy's reason, with each replica's cost>``; the
request id is the client's ``x-request-id`` where it sent one.

What differs from our own cluster: a request with a ``cache_salt`` is hashed without it (a
miss, never a wrong hit); a gap that vLLM's replay buffer no longer covers clears the
replica's entry and its lost chains stay unpublished until they are evicted (this router
cannot reset a replica's cache).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ray.llm._internal.serve.routing_policies.kv_aware.kv_aware_router import KVAwareRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from cluster import ray_llm_events
from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.records import RoutingRequest
from kvindex.writer import IndexWriter
from replica.publisher import IndexPublisher
from replica.vllm.bridge import KVEventBridge
from replica.vllm.events import EventSubscriber
from router.config import for_vllm, routing_config
from router.serve.router import PrefixAwareRequestRouter

log = logging.getLogger("ray.serve")
TOKEN_IDS = "request_token_ids"  # Ray's ingress's keyword (kv_aware.constants)
FORWARD_BODY = "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"  # HAProxy -> /internal/route
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
        section = for_vllm(routing_config(**(routing or {}))).model_dump()  # vLLM's defaults
        super().initialize_state(routing=section, model_id=MODEL_ID, index=index)
        self._feeds: dict[str, ReplicaFeed] = {}
        self._feeds_lock = threading.Lock()
        self._hasher: BlockHasher | None = None
        self._routes: dict[str, RoutingRequest] = {}  # Serve's request id -> its route
        self._booked_at: OrderedDict[str, float] = OrderedDict()  # request id -> when, oldest first
        self._listening = ray_llm_events.listen(self)
        if os.environ.get(FORWARD_BODY) != "1":  # the silent failure of Ray's path: say it
            log.warning(
                "%s is not 1 here: Ray's ingress is then handed no request body, and this "
                "router no token ids to route on (every request goes to any replica)",
                FORWARD_BODY,
            )

    async def rank_candidates(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        if not self._listening:  # the ingress builds its tracker before it routes
            self._listening = ray_llm_events.listen(self)
        self._expire(time.monotonic())
        ranks = await super().rank_candidates(candidate_replicas, pending_request)
        self._book_first_choice(pending_request)
        return ranks

    def _book_first_choice(self, pending_request: PendingRequest | None) -> None:
        """Book the request where Ray's ingress sends it, its first choice (module
        docstring): Serve will not say where it went."""
        request = self.routing_request(pending_request)
        if request is None or pending_request is None:
            return
        self._routes.pop(pending_request.metadata.internal_request_id, None)
        pending = self._decisions.get(request.request_id)
        if pending is None or not pending.decision.ranking:
            return
        first = pending.decision.ranking[0]
        self.stats.record_routed(first)
        self.book(request.request_id, first)
        self._booked_at[request.request_id] = time.monotonic()
        # one line per decision, as Serve's access log has one per request: Ray's app says
        # nowhere else which replica a request went to, or why
        log.info("routed %s to %s: %s", request.request_id, first, pending.reason)

    def _expire(self, now: float) -> None:
        """Release the bookings whose end never came (lost reports)."""
        ttl = self.config.booking_ttl_s
        while self._booked_at:
            request_id, at = next(iter(self._booked_at.items()))
            if now - at < ttl:
                return
            self._released(request_id)

    def prefill_reported(self, request_id: str) -> None:
        """A replica reported the request's first token (on the ingress's loop)."""
        self._on_own_loop(self.prefill_done, request_id)

    def end_reported(self, request_id: str) -> None:
        """A replica reported the request over (on the ingress's loop)."""
        self._on_own_loop(self._released, request_id)

    def _released(self, request_id: str) -> None:
        self._booked_at.pop(request_id, None)
        self.release(request_id)

    def _on_own_loop(self, call: Callable[[str], None], request_id: str) -> None:
        """Run ``call`` where this router's bookings live: its decisions' loop (as
        ``router.serve.link`` hands the ingress's calls over)."""
        loop = self.loop
        if loop is not None and not loop.is_closed():  # None: no decision yet, nothing booked
            loop.call_soon_threadsafe(call, request_id)

    def _follow(self, replicas: list[RunningReplica]) -> None:
        """A feed for every replica that advertises its events and has none yet (called
        from ``update_replicas`` alone: a replica's routing stats reach this router only
        with such an update, so a ranking has nothing new to follow)."""
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
        ids = pending_request.kwargs.get(TOKEN_IDS) or _prompt_ids(pending_request)
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
        """Serve's news of the replica set, sent again whenever a replica's routing stats
        change: a replica that now advertises its events is followed at once, not at the
        next request ranked (with no request in between, a replica whose stats came after
        the last one went unfollowed, and its blocks unpublished, until traffic came)."""
        super().update_replicas(replicas)
        self._follow(replicas)
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


def _prompt_ids(pending: PendingRequest) -> list[int] | None:
    """A completion's prompt when the client sent it as token ids (one prompt, or a batch of
    one): Ray's ingress forwards ids only for a text prompt or a chat, and these are already
    exactly what vLLM will prefill."""
    payload = pending.args[0] if pending.args else None
    prompt = getattr(payload, "prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def _max_tokens(pending: PendingRequest) -> int:
    """The request's output cap, from the routing payload Ray's ingress passes (0: none)."""
    payload = pending.args[0] if pending.args else None
    for field in ("max_completion_tokens", "max_tokens"):
        value = getattr(payload, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0
