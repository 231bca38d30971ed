"""Every ingress's metrics in one scrape: each ingress replica publishes its own Prometheus
text to Redis every ``PERIOD_S`` (a key per ingress, expiring after ``TTL_S``), and its
``/metrics`` answers the union, each ingress's series labelled ``ingress="<id>"``.

Serve's proxy sends a scrape to any one ingress, so without this a scrape sees a random
ingress's counters. With it, ``sum without (ingress)`` gives the cluster's totals and a
filter on ``ingress`` one ingress's. The engine replicas' gauges (``prefix_serve_replica_*``,
what this ingress's router last heard from each replica) are the same wherever they are read,
so they come from the ingress scraped, unlabelled, and are not published. With one ingress
replica (``ingress_replicas: 1``) nothing is shared and ``/metrics`` is that ingress's own
text, unlabelled. An ingress that
died drops out when its key expires; one Redis error leaves the others out of that scrape
(its own series are always there).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvindex import keys
from kvindex.background import Background
from kvindex.config import IndexConfig

log = logging.getLogger("ray.serve")

PERIOD_S = 5.0
TTL_S = 15.0
LOCAL_ONLY = "prefix_serve_replica_"  # the engine replicas' gauges: not per ingress


def share_key(namespace: str, ingress_id: str) -> str:
    return f"{namespace}:im:{ingress_id}"


class MetricsShare(Background):
    """One ingress's side: a thread publishing its text, and a read of the others'."""

    thread_name = "metrics-share"

    def __init__(
        self,
        config: IndexConfig,
        model_id: str,
        text: Callable[[], bytes],
        ingress_id: str | None = None,
    ) -> None:
        super().__init__()
        self.ingress_id = ingress_id or uuid.uuid4().hex[:12]
        self.namespace = keys.namespace(config.cluster, model_id)
        self.text = text
        self._redis = redis.Redis.from_url(
            config.url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
        )

    def stop(self) -> None:
        """Stop publishing and leave the others' scrapes at once (not a TTL later)."""
        self._halt()
        with contextlib.suppress(redis.RedisError, OSError):  # else it expires
            self._redis.delete(share_key(self.namespace, self.ingress_id))
        self._redis.close()

    def publish(self) -> None:
        key = share_key(self.namespace, self.ingress_id)
        self._redis.set(key, own_text(self.text()), ex=int(TTL_S))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
            except (redis.RedisError, OSError) as exc:
                log.warning("could not share this ingress's metrics: %s", exc)
            self._stop.wait(PERIOD_S)

    def others(self) -> dict[str, bytes]:
        """The other live ingresses' latest texts (empty if Redis does not answer)."""
        prefix = share_key(self.namespace, "")
        try:
            names = list(self._redis.scan_iter(match=f"{prefix}*", count=100))
            names = [k for k in names if k.decode()[len(prefix) :] != self.ingress_id]
            texts = self._redis.mget(names) if names else []
        except (redis.RedisError, OSError) as exc:
            log.warning("metrics of the other ingresses unavailable: %s", exc)
            return {}
        return {
            k.decode()[len(prefix) :]: t for k, t in zip(names, texts, strict=True) if t is not None
        }

    def merged(self) -> bytes:
        """This scrape's answer: every live ingress's series, labelled."""
        return merged(self.ingress_id, self.text(), self.others())


def own_text(text: bytes) -> bytes:
    """What an ingress publishes: its text without the engine replicas' gauges."""
    families = [f for f in _parse(text) if not f.name.startswith(LOCAL_ONLY)]
    return _render(families)


def merged(own_id: str, own: bytes, others: dict[str, bytes]) -> bytes:
    """The union of this ingress's text and the others', each ingress's series labelled."""
    by_name: dict[str, Metric] = {}
    for ingress, text in [(own_id, own), *sorted(others.items())]:
        for family in _parse(text):
            local = family.name.startswith(LOCAL_ONLY)
            if local and ingress != own_id:
                continue
            into = by_name.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            for sample in family.samples:
                labels = sample.labels if local else {**sample.labels, "ingress": ingress}
                into.samples.append(sample._replace(labels=labels))
    return _render(by_name.values())


def _parse(text: bytes) -> Iterator[Metric]:
    return text_string_to_metric_families(text.decode())


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


def _render(families: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return generate_latest(registry)
