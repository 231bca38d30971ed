"""The ingress's admission cap is one for the cluster: with several ingress replicas each
one counts what the others have in the engines (their routers' shared bookings, read from
its router's mirror of the index), and takes an even share of the cap only while it cannot
know."""

from __future__ import annotations

import pytest
from conftest import tiny

from cluster.api.errors import APIError
from cluster.config import ClusterArgs
from cluster.ingress import Admission


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
