"""Server-side latency from a cluster's ``/metrics``: the per-tenant TTFT histogram
(``prefix_serve_tenant_ttft_seconds``, measured at the ingress) scraped before and after a
phase, so a client's TTFT can be split into the ingress's part and the HTTP path before it."""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

FAMILY = "prefix_serve_tenant_ttft_seconds"
Buckets = dict[str, dict[float, float]]  # tenant -> upper bound -> cumulative count


def tenant_ttft_buckets(base_url: str, api_key: str) -> Buckets:
    """Each tenant's cumulative TTFT bucket counts, as the ingress has them now."""
    text = httpx.get(
        f"{base_url}/metrics", headers={"authorization": f"Bearer {api_key}"}, timeout=10
    ).text
    out: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name != FAMILY:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                tenant = out.setdefault(sample.labels["tenant"], {})
                tenant[float(sample.labels["le"])] = sample.value
    return out


def between(before: Buckets, after: Buckets) -> dict[str, dict[str, float | None]]:
    """Per tenant, what was observed between two scrapes: the count and the upper bounds of
    the buckets holding the 50th and 99th percentiles (None: beyond the last finite one)."""
    out: dict[str, dict[str, float | None]] = {}
    for tenant, now in after.items():
        then = before.get(tenant, {})
        counts = {le: now[le] - then.get(le, 0.0) for le in sorted(now)}
        total = counts.get(math.inf, 0.0)
        if total <= 0:
            continue
        out[tenant] = {"count": total} | {
            f"p{q}_at_most_s": _bound(counts, total * q / 100) for q in (50, 99)
        }
    return out


def _bound(cumulative: dict[float, float], rank: float) -> float | None:
    """The first bucket's upper bound whose cumulative count reaches ``rank``."""
    le = next(le for le, count in cumulative.items() if count >= rank)
    return le if math.isfinite(le) else None
