"""The Serve application: ``serve run deploy/config.yaml`` calls ``build_app(args)``."""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import ClusterArgs
from cluster.ingress import Ingress
from replica.deployment import EngineReplica
from replica.vllm_replica import VLLMReplica
from router.config import RayRouting

# Ray's own prefix router, a peer to compare with (ships inside `ray`); ``ray_default`` is
# Serve's default router (power of two choices), which needs no class named
RAY_PREFIX_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
    "PrefixCacheAffinityRouter"
)


def request_router_config(args: ClusterArgs) -> RequestRouterConfig:
    """The engine deployment's router: ours for our policies, else one of Ray's."""
    routing = args.routing
    period = {"request_routing_stats_period_s": routing.stats_period_s}
    if isinstance(routing, RayRouting):
        if routing.router_class is not None:
            return RequestRouterConfig(request_router_class=routing.router_class, **period)
        if routing.policy == "ray_prefix":
            return RequestRouterConfig(request_router_class=RAY_PREFIX_ROUTER, **period)
        return RequestRouterConfig(**period)
    kwargs = {
        "routing": routing.model_dump(),
        "model_id": args.engine.model_id,
        "index": args.index.model_dump(),
        "pull": args.pull.prices().model_dump(),  # the router's part of each section
        "store": args.store.prices().model_dump(),
    }
    return RequestRouterConfig(
        request_router_class="router.serve.router:PrefixAwareRequestRouter",
        request_router_kwargs=kwargs,
        **period,
    )


DRAIN_POLL_S = 0.2


def build_app(args: dict[str, Any]) -> Application:
    """Ingress plus ``num_replicas`` engine replicas behind the configured router."""
    cluster = ClusterArgs.model_validate(args)
    scaling: dict[str, Any] = (
        {"autoscaling_config": cluster.autoscaling.model_dump()}
        if cluster.autoscaling
        else {"num_replicas": cluster.num_replicas}
    )
    if cluster.max_replicas_per_node is not None:  # else Serve's default: spread, softly
        scaling["max_replicas_per_node"] = cluster.max_replicas_per_node
    replica = VLLMReplica if cluster.engine.backend == "vllm" else EngineReplica
    engine = replica.options(
        **scaling,
        max_ongoing_requests=cluster.engine_max_ongoing,
        # The ingress's Admission is the one queue cap: Serve's own would count requests
        # still being assigned to a free slot as queued and shed a burst too early.
        max_queued_requests=-1,
        ray_actor_options={
            "num_cpus": cluster.replica_num_cpus,
            "resources": cluster.replica_resources,
        },
        graceful_shutdown_timeout_s=cluster.drain_timeout_s,
        # Serve polls a stopping replica's ongoing requests this often: moved streams leave
        # at once, and the replica should not then wait out Serve's 2 s default
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S if cluster.moves.enabled else 2.0,
        request_router_config=request_router_config(cluster),
    ).bind(cluster.replica_args().model_dump())
    return Ingress.options(
        num_replicas=cluster.ingress_replicas,
        ray_actor_options={
            "num_cpus": cluster.ingress_num_cpus,
            "resources": cluster.ingress_resources,
        },
    ).bind(engine, cluster.model_dump())
