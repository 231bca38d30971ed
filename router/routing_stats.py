"""What a request router saw, for ``/metrics`` and ``/cluster/stats``: its Prometheus metrics
(one registry per process) and ``RouterStats``, the counters each router keeps."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from kvindex.measure import percentile
from router.notes import RouteNote

ROUTED = Counter(
    "prefix_serve_routed_requests", "Requests sent to each engine replica", ["replica", "policy"]
)
DECISION_SECONDS = Histogram(
    "prefix_serve_routing_decision_seconds",
    "Time to rank replicas for one request (index query included)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
)
INDEX_ANSWERS = Counter("prefix_serve_index_answers", "Index queries by outcome", ["outcome"])
ROUTING_ERRORS = Counter(
    "prefix_serve_routing_errors",
    "Decisions that raised (a defect): the request went to any replica instead of waiting",
)
# with index.mirror (set at collection, from the router's mirror: router.serve.router)
MIRROR_SYNCED = Gauge(
    "prefix_serve_index_mirror_synced",
    "1 while this router's mirror of the index answers, 0 while it does not; NaN without a "
    "mirror (index.mirror false: an alert on == 0 stays quiet)",
)
MIRROR_SYNCED.set(float("nan"))
MIRROR_SYNCED_AT = Gauge(
    "prefix_serve_index_mirror_synced_at_seconds",
    "Unix time this router's mirror last became synced (after a snapshot); 0: never",
)
_REPLICA_KEYS = (
    "hit_rate",
    "prompt_tokens",
    "cached_prompt_tokens",
    "blocks_free",
    "blocks_cached",
    "blocks_in_use",
    # sessions' retained blocks (replica.engine.blocks.retention)
    "blocks_pinned",
    "sessions_retained",
    "retention_pinned",
    "retention_renewed",
    "retention_expired",
    "retention_released_for_room",
    "num_running",
    "num_waiting",
    "preemptions",
    "failed_requests",
    # prompt-lookup drafts (replica.engine.speculation): verified, kept, steps they saved
    "draft_tokens",
    "accepted_draft_tokens",
    "draft_steps_saved",
    # pulls (replica.pull) and the node store (replica.store): counted apart
    "pulls",
    "pulled_blocks",
    "pulled_bytes",
    "pull_seconds",
    "pulls_failed",
    "failed_pull_seconds",
    "pull_blocks_refused",
    "pull_lookups_failed",
    "store_spilled_blocks",
    "store_spill_dropped",
    "store_restored_blocks",
    "store_restored_disk_blocks",
    "store_restore_rejected",
    "store_restore_seconds",
    "store_spill_wait_seconds",
    "store_spill_wait_timeouts",
    "store_blocks",
    "store_kept_full",
    # the replica's feed of the index: events it could not deliver (README "Observability")
    "index_in_sync",
    "index_dropped_batches",
    "index_overflows",
    "index_resyncs",
    # streams and hot prefixes handed to other replicas (replica.moves)
    "moves",
    "moves_failed",
    "moved_blocks",
    "moved_bytes",
    "move_seconds",
    "moves_received",
    "received_blocks",
    "handoff_prefixes",
    "handoff_blocks",
)
REPLICA_GAUGES = {
    key: Gauge(f"prefix_serve_replica_{key}", f"Engine replica {key} (routing stats)", ["replica"])
    for key in _REPLICA_KEYS
}
TENANT_CACHED = Gauge(
    "prefix_serve_replica_tenant_cached_blocks",
    "Engine replica's cached blocks owned by each tenant (its share of the pool)",
    ["replica", "tenant"],
)
_MAX_NOTES = 1024  # recent decisions the ingress may still ask about


class RouterStats:
    """Requests routed per replica, recent decision times, and what recent requests' routing
    was (``RouteNote``: for the ``x-routing`` header, the trace and the reuse ledger)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.routed: dict[str, int] = {}
        self.decision_s: deque[float] = deque(maxlen=10_000)
        self.errors = 0  # decisions that raised (``prefix_serve_routing_errors``)
        self._notes: OrderedDict[str, RouteNote] = OrderedDict()
        self._tenants_seen: dict[str, set[str]] = {}  # tenants with a gauge, per replica

    def record_decision(self, seconds: float) -> None:
        self.decision_s.append(seconds)
        DECISION_SECONDS.observe(seconds)

    def record_note(self, request_id: str, note: RouteNote) -> None:
        """Where ``request_id`` went and why (its latest routing: a resumed request's
        continuation replaces the first)."""
        self._notes[request_id] = note
        self._notes.move_to_end(request_id)
        while len(self._notes) > _MAX_NOTES:
            self._notes.popitem(last=False)

    def _tenant_gauges(self, replica_id: str, held: Mapping[str, int]) -> None:
        """Each tenant's cached blocks on a replica; 0 for one that had some and has none."""
        seen = self._tenants_seen.setdefault(replica_id, set())
        for tenant in seen - set(held):
            TENANT_CACHED.labels(replica_id, tenant).set(0)
        for tenant, blocks in held.items():
            TENANT_CACHED.labels(replica_id, tenant).set(blocks)
        seen |= set(held)

    def record_routed(self, replica_id: str) -> None:
        self.routed[replica_id] = self.routed.get(replica_id, 0) + 1
        ROUTED.labels(replica_id, self.policy).inc()

    def note(self, request_id: str) -> RouteNote | None:
        return self._notes.get(request_id)

    def snapshot(self, replica_stats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """These counters, with the replicas' latest routing stats (which also set the
        per-replica gauges)."""
        for rid, values in replica_stats.items():
            for key, gauge in REPLICA_GAUGES.items():
                if isinstance(values.get(key), int | float):
                    gauge.labels(rid).set(values[key])
            self._tenant_gauges(rid, values.get("blocks_cached_by_tenant") or {})
        return {
            "policy": self.policy,
            "routed": dict(self.routed),
            "replicas": {rid: dict(values) for rid, values in replica_stats.items()},
            "decision_p50_s": percentile(self.decision_s, 50),
            "decision_p99_s": percentile(self.decision_s, 99),
            "routing_errors": self.errors,
        }
