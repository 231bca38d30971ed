"""The ingress's admission cap is one for the cluster: with several ingress replicas each
one counts what the others have in the engines (their routers' shared bookings, read from
its router's mirror of the index), and takes an even share of the cap only while it cannot
know."""

from __future__ import annotations

import pytest
from conftest import tiny

from cluster.admission import Admission
from cluster.api.errors import APIError
from cluster.config import ClusterArgs


def args(ingress_replicas: int, queued: int = 4) -> ClusterArgs:
    return ClusterArgs(
        num_replicas=2,
        ingress_replicas=ingress_replicas,
        max_ongoing_requests=4,
        max_queued_requests=queued,
        engine=tiny(),
    )


def admitted(admission: Admission, tries: int = 20) -> int:
    n = 0
    for _ in range(tries):
        try:
            admission.enter()
        except APIError as exc:
            assert exc.status == 503
            break
        n += 1
    return n


def test_one_ingress_holds_the_whole_cap() -> None:
    assert admitted(Admission(args(1), others=lambda: 100)) == 2 * 4 + 4  # others not asked


def test_two_ingresses_share_one_cap_by_what_the_others_hold() -> None:
    others = {"in_flight": 0}
    admission = Admission(args(2), others=lambda: others["in_flight"])
    others["in_flight"] = 9  # the other ingress's router shared 9 requests in the engines
    assert admitted(admission) == 3
    admission.leave(3)
    others["in_flight"] = 0  # they finished: this one may take the whole cap
    assert admitted(admission) == 12


def test_without_a_view_of_the_others_each_takes_an_even_share() -> None:
    assert admitted(Admission(args(2), others=lambda: None)) == 6


@pytest.mark.parametrize("ingress_replicas", [1, 2])
def test_no_cap_when_nothing_may_queue_without_limit(ingress_replicas: int) -> None:
    assert admitted(Admission(args(ingress_replicas, queued=-1), others=lambda: 99)) == 20


def test_the_cap_follows_the_engine_replicas_serve_runs() -> None:
    """Scaling in place: 2 configured, 3 running moves the cap up at once; back to 2 it
    comes down only after the lower count held 30 s (a killed replica being replaced keeps
    its slots); unknown (None) keeps the last count."""
    now = {"t": 0.0}
    running: dict[str, int | None] = {"n": None}
    admission = Admission(args(1), replicas=lambda: running["n"], clock=lambda: now["t"])
    assert admission.cluster_limit == 2 * 4 + 4
    running["n"] = 3
    assert admission.cluster_limit == 3 * 4 + 4
    assert admitted(admission) == 16
    admission.leave(16)
    running["n"] = 2
    now["t"] = 1.0  # first seen 2 now
    assert admission.cluster_limit == 16
    now["t"] = 30.5
    assert admission.cluster_limit == 16
    now["t"] = 31.5
    assert admission.cluster_limit == 12
    running["n"] = None
    assert admission.cluster_limit == 12


def test_with_autoscaling_the_cap_counts_max_replicas() -> None:
    fields = args(1).model_dump() | {"autoscaling": {"min_replicas": 1, "max_replicas": 5}}
    autoscaled = ClusterArgs.model_validate(fields)
    admission = Admission(autoscaled, replicas=lambda: 1)
    assert admission.cluster_limit == 5 * 4 + 4
