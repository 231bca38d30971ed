"""The benchmarks' timed copy of Ray's default router answers everything the ingress asks
of its router (``router.serve.link.LinkedRouter``): the ``ray_default`` runs of ``bench
routing`` failed every request when the protocol grew and this class did not."""

from __future__ import annotations

import inspect

from bench.peers.ray_router import TimedPowerOfTwoRouter
from router.serve.link import LinkedRouter
from router.serve.router import PrefixAwareRequestRouter


def protocol_methods() -> set[str]:
    return {
        name
        for name, member in inspect.getmembers(LinkedRouter, inspect.isfunction)
        if not name.startswith("_")
    }


def test_every_router_the_ingress_links_to_answers_the_whole_protocol() -> None:
    """Each method the link calls exists on both routers, with the protocol's parameters."""
    wanted = protocol_methods()
    assert {"prefill_done", "engine_replicas", "others_in_flight", "close"} <= wanted
    for router in (TimedPowerOfTwoRouter, PrefixAwareRequestRouter):
        for name in wanted:
            theirs = inspect.signature(getattr(router, name)).parameters
            ours = inspect.signature(getattr(LinkedRouter, name)).parameters
            assert list(theirs) == list(ours), f"{router.__name__}.{name}"
