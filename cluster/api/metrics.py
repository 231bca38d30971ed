"""Prometheus metrics of the HTTP API, exported at the ingress's ``/metrics``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("prefix_serve_requests", "HTTP API requests by status", ["endpoint", "status"])
PROMPT_TOKENS = Counter("prefix_serve_prompt_tokens", "Prompt tokens served")
CACHED_TOKENS = Counter("prefix_serve_cached_prompt_tokens", "Prompt tokens served from cache")
COMPLETION_TOKENS = Counter("prefix_serve_completion_tokens", "Generated tokens")
RESUMES = Counter(
    "prefix_serve_resumed_requests",
    "Requests sent again after their replica died, before their first token or mid-stream",
    ["when", "outcome"],
)
MOVES = Counter(
    "prefix_serve_moved_requests",
    "Streams a replica handed to another mid-request (replica.moves), by why and whether "
    "their KV went with them (pushed) or the next replica recomputed it",
    ["reason", "outcome"],
)
TTFT = Histogram(
    "prefix_serve_ttft_seconds",
    "Time from request to first token, at the ingress",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
# the fair queue (cluster.gate), per tenant (cluster.tenants: a plain key's tenant is named
# after its hash, never the key)
TENANT_QUEUED = Gauge(
    "prefix_serve_tenant_queued_requests", "Requests waiting at this ingress", ["tenant"]
)
TENANT_WAIT = Histogram(
    "prefix_serve_tenant_queue_wait_seconds",
    "Time a request waited at the ingress for an engine slot",
    ["tenant", "priority"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TENANT_REJECTED = Counter(
    "prefix_serve_tenant_rejected_requests",
    "Requests refused at the ingress, by reason (queue_full, queue_timeout)",
    ["tenant", "reason"],
)
TENANT_EXPRESS = Counter(
    "prefix_serve_tenant_express_requests",
    "Requests started on an express slot (a light tenant or a higher priority, slots full)",
    ["tenant"],
)
TENANT_TTFT = Histogram(
    "prefix_serve_tenant_ttft_seconds",
    "Time from the ingress receiving a request to its first token, per tenant (its wait at "
    "the ingress included; the client's own TTFT adds the HTTP path before the ingress)",
    ["tenant"],
    buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30),
)
TENANT_PROMPT_TOKENS = Counter(
    "prefix_serve_tenant_prompt_tokens", "Prompt tokens of a tenant's requests", ["tenant"]
)
TENANT_CACHED_TOKENS = Counter(
    "prefix_serve_tenant_cached_prompt_tokens",
    "Prompt tokens of a tenant's requests served from cache (over prompt tokens: its hit rate)",
    ["tenant"],
)
TENANT_CHARGED = Counter(
    "prefix_serve_tenant_charged_tokens",
    "Tokens charged to a tenant: prompt tokens not served from cache, and output tokens",
    ["tenant"],
)
# the reuse ledger (cluster.reuse): per prompt, tokens reusable anywhere in the fleet, held
# by the replica it was routed to, and served from cache there (by source)
REUSE_REUSABLE = Counter(
    "prefix_serve_reuse_reusable_tokens",
    "Prompt tokens cached anywhere in the fleet (any replica or node store) at routing",
    ["tenant", "policy"],
)
REUSE_ROUTED = Counter(
    "prefix_serve_reuse_routed_tokens",
    "Prompt tokens the replica a request was routed to held (cached or booked)",
    ["tenant", "policy"],
)
REUSE_DELIVERED = Counter(
    "prefix_serve_reuse_delivered_tokens",
    "Prompt tokens served from cache by the engine: its own (local), restored from the node "
    "store, or pulled from another replica",
    ["tenant", "policy", "source"],
)
REUSE_CAPTURED = Histogram(
    "prefix_serve_reuse_captured_ratio",
    "Per request with reusable tokens: delivered / reusable (capped at 1)",
    ["policy"],
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
)
