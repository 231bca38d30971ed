"""One scrape, every ingress: each ingress's /metrics text, published to Redis, comes back
in any ingress's answer with an ``ingress`` label (so summing over it gives the cluster's
totals); the engine replicas' gauges come unlabelled from the ingress scraped; a stopped
ingress leaves at once."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics_share import MetricsShare
from kvindex.config import IndexConfig


def ingress_text(requests: float, hit_rate: float) -> bytes:
    registry = CollectorRegistry()
    Counter("prefix_serve_requests", "", ["status"], registry=registry).labels("200").inc(requests)
    Gauge("prefix_serve_replica_hit_rate", "", ["replica"], registry=registry).labels("r0").set(
        hit_rate
    )
    return generate_latest(registry)


def samples(text: bytes, name: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_every_ingress_is_in_one_scrape_labelled_and_leaves_when_stopped(fresh_redis) -> None:
    config = IndexConfig(url=fresh_redis.url)
    a = MetricsShare(config, "m", lambda: ingress_text(3, 0.5), "ingress-a")
    b = MetricsShare(config, "m", lambda: ingress_text(4, 0.9), "ingress-b")
    other_model = MetricsShare(config, "other", lambda: ingress_text(100, 0.0), "ingress-c")
    for share in (a, b, other_model):
        share.publish()
    scraped = a.merged()
    requests = samples(scraped, "prefix_serve_requests_total")
    assert requests == {
        (("ingress", "ingress-a"), ("status", "200")): 3.0,
        (("ingress", "ingress-b"), ("status", "200")): 4.0,
    }
    assert sum(requests.values()) == 7.0  # the cluster's total, one scrape
    # the replicas' gauges: this ingress's view only, no ingress label, not doubled
    assert samples(scraped, "prefix_serve_replica_hit_rate") == {(("replica", "r0"),): 0.5}
    b.stop()
    assert set(samples(a.merged(), "prefix_serve_requests_total")) == {
        (("ingress", "ingress-a"), ("status", "200"))
    }


def test_without_redis_a_scrape_still_has_its_own_ingress() -> None:
    share = MetricsShare(
        IndexConfig(url="redis://127.0.0.1:1", timeout_s=0.2), "m", lambda: ingress_text(2, 0.1)
    )
    requests = samples(share.merged(), "prefix_serve_requests_total")
    assert list(requests.values()) == [2.0]
