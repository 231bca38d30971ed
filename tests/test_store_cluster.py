"""The node store on a real cluster (round robin over two replicas, so every other request
goes to the replica that did not compute its prompt): the next request, sent the moment the
last one answered, restores the prefix the other replica computed (an answer waits for its
blocks' spill); and a cluster stopped and started again starts warm from the node's store,
which outlives it on purpose (the fingerprint keeps other weights and other code out)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest
from conftest import keep_logs, tiny

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from router.config import routing_config

MODEL = "tiny-llama-6m"


def cluster_args(redis_server: LocalRedis) -> ClusterArgs:
    return ClusterArgs(
        num_replicas=2,
        engine=tiny(num_threads=1, num_blocks=512),
        routing=routing_config(policy="round_robin", stats_period_s=0.5),
        index=IndexConfig(url=redis_server.url, cluster="storecluster"),
    )


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[ServeCluster]:
    failed = request.session.testsfailed
    c = ServeCluster(cluster_args(redis_server)).start()
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


def ask(client: openai.OpenAI, system: str, question: str) -> tuple[str, int, int]:
    """(replica, prompt tokens, cached prompt tokens) of one greedy chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0.0,
    )
    usage = raw.parse().usage
    return (
        raw.headers["x-replica-id"],
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
    )


def system_prompt(tag: str) -> str:
    return f"Ledger {tag}. " + "Every storm of the season, its date and the damage it did. " * 40


def test_the_next_request_on_the_other_replica_restores_what_the_last_one_computed(
    cluster: ServeCluster,
) -> None:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    for round_ in range(3):
        system = system_prompt(f"round {round_}")
        first, prompt_tokens, cached = ask(client, system, "Which came first?")
        assert cached <= 32 and prompt_tokens >= 2400  # computed (the template's head aside)
        second, prompt_tokens, cached = ask(client, system, "Which did the most damage?")
        assert second != first  # round robin: the replica that never saw the prompt
        assert cached >= prompt_tokens - 48, (round_, cached, prompt_tokens)  # restored
    # Whether an answer had to wait for its spill is a race between the two (a spill done
    # first leaves nothing to wait for; the CI run of 9078196 counted fewer than the 6 waits
    # this once required); what must hold is the restores above and that no wait timed out.
    # The routing stats lag a period behind.
    time.sleep(3 * 0.5)
    stats = replicas(cluster)
    assert all("store_spill_wait_timeouts" in r for r in stats)
    assert sum(r["store_spill_wait_timeouts"] for r in stats) == 0


def replicas(cluster: ServeCluster) -> list[dict]:
    return list(cluster.stats()["replicas"].values())


def test_a_cluster_started_again_starts_warm_from_the_node_store(
    cluster: ServeCluster, redis_server: LocalRedis
) -> None:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    system = system_prompt("kept over a restart")
    ask(client, system, "Which came first?")
    cluster.stop(keep_store=True)
    again = ServeCluster(cluster_args(redis_server)).start()
    try:
        client = openai.OpenAI(base_url=f"{again.base_url}/v1", api_key="x", max_retries=0)
        _, prompt_tokens, cached = ask(client, system, "Which did the most damage?")
        assert cached >= prompt_tokens - 48
    finally:
        again.stop()
