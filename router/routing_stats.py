"""What this process's request routers saw, for ``/metrics`` and ``/cluster/stats``.

Kept apart from ``router.serve_router`` on purpose: Serve pickles the router's module by
value, so state that must be shared with the ingress (and anything holding a lock) lives here
and is reached as ``routing_stats.STATE``, never imported into the router's namespace.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, deque
from dataclasses import asdict
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from replica.engine.stats import percentile

ROUTED = Counter(
    "prefix_serve_routed_requests", "Requests sent to each engine replica", ["replica", "policy"]
)
DECISION_SECONDS = Histogram(
    "prefix_serve_routing_decision_seconds",
    "Time to rank replicas for one request (index query included)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
)
INDEX_ANSWERS = Counter("prefix_serve_index_answers", "Index queries by outcome", ["outcome"])
_REPLICA_KEYS = (
    "hit_rate",
    "prompt_tokens",
    "cached_prompt_tokens",
    "blocks_free",
    "blocks_cached",
    "blocks_in_use",
    "num_running",
    "num_waiting",
    "preemptions",
)
REPLICA_GAUGES = {
    key: Gauge(f"prefix_serve_replica_{key}", f"Engine replica {key} (routing stats)", ["replica"])
    for key in _REPLICA_KEYS
}


class RouterState:
    """Requests routed, recent decision times and reasons, and the live replicas' routing
    stats (read from the router when asked, as Serve pushes them every stats period). The
    ingress reaches the router through it (``prefill_done``, ``reason``)."""

    def __init__(self) -> None:
        self.policy = ""
        self.routed: dict[str, int] = {}
        self.decision_s: deque[float] = deque(maxlen=10_000)
        self._reasons: OrderedDict[str, str] = OrderedDict()  # request -> why it went there
        self._router: weakref.ref[Any] | None = None

    def attach(self, router: Any) -> None:
        """The request router whose live replicas to report (held weakly)."""
        self._router = weakref.ref(router)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Latest routing stats per live replica; also sets the per-replica gauges."""
        router = self._router() if self._router is not None else None
        if router is None:
            return {}
        stats = {
            r.replica_id.unique_id: dict(r.routing_stats or {})
            for r in router.curr_replicas.values()
        }
        for rid, values in stats.items():
            for key, gauge in REPLICA_GAUGES.items():
                if key in values:
                    gauge.labels(rid).set(values[key])
        return stats

    def record_decision(self, request_id: str, seconds: float, reason: str) -> None:
        self.decision_s.append(seconds)
        DECISION_SECONDS.observe(seconds)
        self._reasons[request_id] = reason
        while len(self._reasons) > _MAX_REASONS:
            self._reasons.popitem(last=False)

    def reason(self, request_id: str) -> str | None:
        """Why the router sent a recent request where it did (its policy's explanation)."""
        return self._reasons.get(request_id)

    def prefill_done(self, request_id: str) -> None:
        """The ingress saw a request's first token: the router releases its prefill load.

        Serve runs the router on an event loop of its own thread: the call is handed to
        that loop (its bookings and its Redis client belong to it), never made here."""
        router = self._router() if self._router is not None else None
        loop = getattr(router, "_event_loop", None)
        if router is not None and loop is not None and hasattr(router, "prefill_done"):
            loop.call_soon_threadsafe(router.prefill_done, request_id)

    def record_routed(self, replica_id: str) -> None:
        self.routed[replica_id] = self.routed.get(replica_id, 0) + 1
        ROUTED.labels(replica_id, self.policy).inc()

    def snapshot(self) -> dict[str, Any]:
        router = self._router() if self._router is not None else None
        index = getattr(router, "index", None)
        return {
            "policy": self.policy,
            "routed": dict(self.routed),
            "index": asdict(index.counters) if index is not None else None,
            "bookings_in_flight": len(router.bookings) if hasattr(router, "bookings") else None,
            "replicas": self.replica_stats(),
            "decision_p50_s": percentile(self.decision_s, 50),
            "decision_p99_s": percentile(self.decision_s, 99),
        }


_MAX_REASONS = 1024
STATE = RouterState()
