"""A replica dies mid-generation: every stream on it resumes on another replica, and each
client gets exactly the text and token count it gets without a failure."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import openai
import pytest
from conftest import keep_logs, tiny
from streams import chat_bodies, resumed, run_streams
from test_serve_e2e import assert_no_leaked_blocks

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from router.config import routing_config

MODEL = "tiny-llama-6m"
SYSTEM = "You answer questions about the weather in one careful paragraph. " * 3
# greedy and seeded sampling, 8 streams: the same system prompt keeps them on one replica
REQUESTS = [
    {"temperature": 0.0} if i < 4 else {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
    for i in range(8)
]


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[ServeCluster]:
    failed = request.session.testsfailed
    args = ClusterArgs(
        num_replicas=2,
        max_ongoing_requests=16,
        engine=tiny(num_threads=1, num_blocks=512),
        routing=routing_config(stats_period_s=0.5),
        index=IndexConfig(url=redis_server.url, cluster="failover"),
    )
    c = ServeCluster(args).start()
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


def bodies() -> list[dict]:
    questions = [f"City number {i}?" for i in range(len(REQUESTS))]
    return chat_bodies(MODEL, SYSTEM, questions, REQUESTS, max_tokens=600)


def test_streams_on_a_killed_replica_resume_token_for_token(cluster: ServeCluster) -> None:
    reference, _ = run_streams(cluster, bodies(), kill=False)
    assert all(s.usage and s.usage["completion_tokens"] == 600 for s in reference)
    before = resumed(cluster)
    streams, victim = run_streams(cluster, bodies(), kill=True)
    on_victim = [s for s in streams if s.replica == victim]
    assert len(on_victim) >= 4  # the test means something: most streams were there
    for got, want in zip(streams, reference, strict=True):
        assert got.errors == []
        assert "".join(got.pieces) == "".join(want.pieces)  # nothing missing, nothing twice
        assert got.usage is not None and want.usage is not None
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert got.usage[key] == want.usage[key]  # every output token counted once
    assert resumed(cluster) - before >= len(on_victim)
    assert_no_leaked_blocks(cluster, timeout_s=60)  # survivors, and bookings released


def test_a_prefix_outlives_its_sigkilled_replica_in_the_node_store(cluster: ServeCluster) -> None:
    """A prompt computed on X, X SIGKILLed: the same prompt again (on the other replica, or
    X's replacement) restores the prefix from the node store, with the same greedy reply."""
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    messages = [
        {"role": "system", "content": "You keep a ledger of every storm and its date. " * 12},
        {"role": "user", "content": "Which storm came first?"},
    ]

    def ask() -> tuple[str, int, int, str]:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0.0
        )
        reply = raw.parse()
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens
        return (
            reply.choices[0].message.content,
            usage.prompt_tokens,
            cached,
            raw.headers["x-replica-id"],
        )

    first, prompt_tokens, cached, holder = ask()
    assert cached <= 32 and prompt_tokens >= 400  # at most the chat template's head
    time.sleep(1.0)  # released, spilled (behind the step), and the stats say where X runs
    os.kill(cluster.stats()["replicas"][holder]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        try:
            again, _, cached, served_by = ask()
            break
        except openai.APIError:  # X's death seen mid-request: the client retries
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert served_by != holder
    assert cached >= (prompt_tokens - 1) // 16 * 16 - 16  # all but the partial last block
    assert again == first
