"""The reuse ledger: for each prompt, how much of it was reusable anywhere in the fleet, how
much the routing decision captured, and how much the engine delivered.

- ``reusable``: the longest cached run of the prompt's blocks on any replica or node store,
  in tokens, by the index's answer at the decision (``router.routing_stats.RouteNote``);
- ``routed``: what the replica the request went to held of it (cached, or booked to be);
- ``delivered``: what that replica's engine served from cache (``num_cached_tokens``): its
  own hit, plus what it restored from the node store or pulled from another replica just
  before (``restored``, ``pulled``).

``routed / reusable`` is the routing decision's quality; ``delivered / reusable`` the
fleet's. ``delivered`` exceeds ``routed`` when a pull or a restore made up what the replica
lacked; ``routed`` exceeds ``delivered`` when what it held was evicted before admission.
Counted in ``/metrics`` per tenant and policy (``cluster.api.metrics``: ``sum(rate(
prefix_serve_reuse_delivered_tokens_total[5m])) / sum(rate(
prefix_serve_reuse_reusable_tokens_total[5m]))`` is the fleet's capture in one expression),
sent as the ``x-prefix-reuse`` header, set on the request's trace, and kept for
``/cluster/decisions`` (the dashboard's table). A prompt whose index answer never came
(``reusable`` unknown) is listed but not counted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from cluster.api import metrics as api_metrics
from replica.messages import RequestOutput
from router.routing_stats import RouteNote


@dataclass(frozen=True)
class Reuse:
    """One prompt's entry in the ledger (tokens; ``reusable`` None: unknown)."""

    request_id: str
    time: float  # Unix time of its first token
    tenant: str
    policy: str
    replica: str
    reason: str
    candidates: int
    prompt_tokens: int
    reusable: int | None
    routed: int
    delivered: int
    restored: int
    pulled: int

    @property
    def local(self) -> int:
        """Delivered from the replica's own cache."""
        return self.delivered - self.restored - self.pulled


def reuse_of(request_id: str, tenant: str, note: RouteNote | None, first: RequestOutput) -> Reuse:
    """The ledger entry of a prompt whose first output is ``first`` (``note``: its routing,
    None when the router kept none: another router, or a note long gone). Its sources add
    up to ``delivered`` (a pulled block evicted before admission is not counted twice)."""
    delivered = first.num_cached_tokens
    pulled = min(first.num_pulled_tokens, delivered)
    restored = min(first.num_restored_tokens, delivered - pulled)
    return Reuse(
        request_id=request_id,
        time=time.time(),
        tenant=tenant,
        policy=note.policy if note is not None else "unknown",
        replica=first.replica_id,
        reason=note.reason if note is not None else "",
        candidates=note.candidates if note is not None else 0,
        prompt_tokens=first.num_prompt_tokens,
        reusable=note.reusable if note is not None else None,
        routed=note.routed if note is not None else 0,
        delivered=delivered,
        restored=restored,
        pulled=pulled,
    )


def header(entries: list[Reuse]) -> str:
    """``x-prefix-reuse``: the three numbers summed over a response's prompts (``reusable``
    "unknown" if any prompt's is)."""
    known = [e.reusable for e in entries]
    reusable = "unknown" if None in known else str(sum(r for r in known if r is not None))
    routed = sum(e.routed for e in entries)
    delivered = sum(e.delivered for e in entries)
    return f"reusable={reusable}; routed={routed}; delivered={delivered}"


class ReuseLedger:
    """This ingress replica's ledger: every entry counted in ``/metrics``, the latest
    ``keep`` listed. Written on the ingress's loop, read by ``/cluster/decisions``."""

    def __init__(self, keep: int = 512) -> None:
        self._recent: deque[Reuse] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.requests = self.prompt_tokens = self.reusable = self.routed = self.delivered = 0

    def record(self, entry: Reuse) -> None:
        with self._lock:
            self._recent.append(entry)
            if entry.reusable is None:
                return
            self.requests += 1
            self.prompt_tokens += entry.prompt_tokens
            self.reusable += entry.reusable
            self.routed += entry.routed
            self.delivered += entry.delivered
        labels = (entry.tenant, entry.policy)
        api_metrics.REUSE_REUSABLE.labels(*labels).inc(entry.reusable)
        api_metrics.REUSE_ROUTED.labels(*labels).inc(entry.routed)
        for source, tokens in (
            ("local", entry.local),
            ("restored", entry.restored),
            ("pulled", entry.pulled),
        ):
            api_metrics.REUSE_DELIVERED.labels(*labels, source).inc(tokens)
        if entry.reusable > 0:
            ratio = min(1.0, entry.delivered / entry.reusable)
            api_metrics.REUSE_CAPTURED.labels(entry.policy).observe(ratio)

    def report(self, limit: int) -> dict[str, object]:
        """The latest ``limit`` entries, oldest first, and the totals counted."""
        with self._lock:
            recent = list(self._recent)[-limit:] if limit > 0 else []
            totals = {
                "requests": self.requests,
                "prompt_tokens": self.prompt_tokens,
                "reusable": self.reusable,
                "routed": self.routed,
                "delivered": self.delivered,
            }
        return {"decisions": [asdict(e) for e in recent], "totals": totals}
