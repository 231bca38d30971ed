"""The deployment files, checked offline: they are valid cluster arguments, and the Kubernetes
RayService serves the same application as deploy/config.yaml. (Every field is documented in
the README's Configuration section: tests/test_readme.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import ClusterArgs

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes"
# What a cluster of machines changes on purpose (README "Kubernetes" says why)
CLUSTER_CHANGES = {
    "num_replicas",
    "replica_num_cpus",
    "ingress_replicas",
    "ingress_num_cpus",
    "index.url",
    "index.cluster",
    "index.timeout_s",
    "index.connect_timeout_s",
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def flatten(args: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in args.items():
        # nested config models are spelled out; mappings the user fills in stay whole
        if isinstance(value, dict) and key != "autoscaling" and not key.endswith("_resources"):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def local_app() -> dict[str, Any]:
    return yaml.safe_load((REPO / "deploy" / "config.yaml").read_text())["applications"][0]


def kube_serve_config() -> dict[str, Any]:
    (service,) = [d for d in documents(KUBE / "rayservice.yaml") if d["kind"] == "RayService"]
    return yaml.safe_load(service["spec"]["serveConfigV2"])


@pytest.mark.parametrize("app", [local_app(), kube_serve_config()["applications"][0]])
def test_both_files_are_valid_cluster_args(app: dict[str, Any]) -> None:
    ClusterArgs.model_validate(app["args"])  # valid, and nothing extra (extra="forbid")
    assert {"engine.model", "engine.dtype", "routing.policy", "index.url"} <= set(
        flatten(app["args"])
    )


def test_the_rayservice_serves_the_same_application() -> None:
    local, kube = local_app(), kube_serve_config()["applications"][0]
    for key in ("name", "route_prefix", "import_path"):
        assert kube[key] == local[key]
    ours, theirs = flatten(local["args"]), flatten(kube["args"])
    differing = {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
    assert differing <= CLUSTER_CHANGES, differing - CLUSTER_CHANGES
    assert kube_serve_config()["proxy_location"] == "EveryNode"


def test_the_rayservice_has_head_and_workers_with_resources_and_finds_redis() -> None:
    (service,) = [d for d in documents(KUBE / "rayservice.yaml") if d["kind"] == "RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert len(groups) >= 2
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            requests = container["resources"]["requests"]
            assert requests["cpu"] and requests["memory"] and container["image"]
    workers = cluster["workerGroupSpecs"][0]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    for container in workers["template"]["spec"]["containers"]:  # ready = can serve
        probe = " ".join(container["readinessProbe"]["exec"]["command"])
        assert "localhost:8000/ready" in probe and "local_raylet_healthz" in probe
    redis_docs = documents(KUBE / "redis.yaml")
    (deployment,) = [d for d in redis_docs if d["kind"] == "Deployment"]
    (svc,) = [d for d in redis_docs if d["kind"] == "Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels == svc["spec"]["selector"]
    port = svc["spec"]["ports"][0]["port"]
    url = kube_serve_config()["applications"][0]["args"]["index"]["url"]
    assert url == f"redis://{svc['metadata']['name']}:{port}/0"
