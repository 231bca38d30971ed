"""Tenants and the fair queue on the real cluster: one engine replica of the tiny model with
one slot (``max_ongoing_requests: 1``), so every other request waits at the ingress, and
keys of three tenants at different priorities, driven by the ``openai`` SDK.

Requests submitted together reach the ingress in no exact order and run for tens of
milliseconds each, so the checks ask for what only a priority queue gives (a request sent
after six others finishes among the first three), not for an exact sequence; without the
fair queue (arrival order) it would finish last. The late requests are sent once the
earlier ones are at the ingress (its own metrics say so), so arrival order is known. The
cluster lends one express slot (``fair_queue.express_slots``, the default): the chat
request, above the batch requests' priority, starts on it at once; the batch tenant, over
its share, is never lent it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from conftest import keep_logs, tiny

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig

MODEL = "tiny-llama-6m"
KEYS = {
    "batch": {"key": "sk-batch", "tenant": "batch", "priority": 0},
    "chat": {"key": "sk-chat", "tenant": "chat", "priority": 5},
    "metered": {"key": "sk-metered", "tenant": "metered", "limits": {"requests_per_minute": 3}},
}


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[ServeCluster]:
    args = ClusterArgs(
        engine=tiny(num_threads=1, num_blocks=256, max_model_len=512),
        num_replicas=1,
        max_ongoing_requests=1,
        max_queued_requests=16,
        max_tokens_limit=64,
        fair_queue={"enabled": True, "deadline_s": 30},
        api_keys=list(KEYS.values()),
        index=IndexConfig(url=redis_server.url, cluster="tenants"),
    )
    failed = request.session.testsfailed
    c = ServeCluster(args).start()
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


def client(cluster: ServeCluster, tenant: str) -> openai.AsyncOpenAI:
    key = KEYS[tenant]["key"]
    return openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key=key, max_retries=0)


def _metrics(cluster: ServeCluster) -> tuple[str, dict[str, float]]:
    """The ingress's ``/metrics`` text, and its tenant samples by series."""
    text = httpx.get(
        f"{cluster.base_url}/metrics", headers={"authorization": "Bearer sk-chat"}, timeout=10
    ).text
    samples = [line.split() for line in text.splitlines() if line.startswith("prefix_serve_")]
    return text, {sample[0]: float(sample[1]) for sample in samples}


def _batch_arrived(cluster: ServeCluster) -> float:
    """The batch tenant's requests that reached the ingress's queue so far: waiting there,
    or gone on to a slot (counted by the queue-wait histogram)."""
    names = (
        'prefix_serve_tenant_queued_requests{tenant="batch"}',
        'prefix_serve_tenant_queue_wait_seconds_count{priority="0",tenant="batch"}',
    )
    values = _metrics(cluster)[1]
    return sum(values.get(name, 0.0) for name in names)


async def _finish_order(cluster: ServeCluster) -> list[str]:
    """Six batch requests, then (once all six are at the ingress) a batch request claiming
    priority 9 in a header and a chat request: the order in which they finished. Waiting
    for the six, not a fixed 50 ms: on a loaded host one of them reached the ingress after
    the late batch request, which the queue then rightly served first (a CI run saw it)."""
    order: list[str] = []
    before = await asyncio.to_thread(_batch_arrived, cluster)

    async def one(name: str, tenant: str, headers: dict[str, str] | None = None) -> None:
        await client(cluster, tenant).completions.create(
            model=MODEL,
            prompt=f"request {name} " * 8,
            max_tokens=32,
            temperature=0,
            extra_headers=headers,
        )
        order.append(name)

    batch = [asyncio.create_task(one(f"batch{i}", "batch")) for i in range(6)]
    deadline = time.monotonic() + 15
    while await asyncio.to_thread(_batch_arrived, cluster) - before < 6:
        assert time.monotonic() < deadline, "the six batch requests never reached the ingress"
        await asyncio.sleep(0.01)
    late = [
        asyncio.create_task(one("claims9", "batch", {"x-priority": "9"})),
        asyncio.create_task(one("chat", "chat")),
    ]
    await asyncio.gather(*batch, *late)
    return order


def test_a_higher_priority_goes_first_and_an_untrusted_header_does_not_raise_one(
    cluster: ServeCluster,
) -> None:
    order = asyncio.run(_finish_order(cluster))
    assert order.index("chat") <= 2, order  # past the batch requests waiting before it
    assert order.index("claims9") >= 5, order  # its key may not raise its priority


def test_a_request_that_cannot_start_by_its_deadline_gets_503_and_retry_after(
    cluster: ServeCluster,
) -> None:
    async def run() -> httpx.Response:
        backlog = [
            client(cluster, "batch").completions.create(
                model=MODEL, prompt=f"backlog {i}", max_tokens=64, temperature=0
            )
            for i in range(8)
        ]
        tasks = [asyncio.create_task(b) for b in backlog]
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as http:
            refused = await http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "in a hurry", "max_tokens": 8},
                headers={"authorization": "Bearer sk-batch", "x-request-timeout": "0.2"},
            )
        await asyncio.gather(*tasks)
        return refused

    refused = asyncio.run(run())
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "overloaded_error"
    assert int(refused.headers["retry-after"]) >= 1


def test_a_tenant_over_its_quota_gets_openais_429_and_headers(cluster: ServeCluster) -> None:
    with httpx.Client(base_url=cluster.base_url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "metered", "max_tokens": 4}
        auth = {"authorization": "Bearer sk-metered"}
        answers = [http.post("/v1/completions", json=body, headers=auth) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0", "0"]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    refused = answers[3]
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert int(refused.headers["retry-after"]) >= 1


def test_metrics_count_each_tenants_tokens_and_refusals(cluster: ServeCluster) -> None:
    async def twice() -> None:  # the second is served from the first's cached blocks
        for _ in range(2):
            await client(cluster, "chat").completions.create(
                model=MODEL, prompt="the same long prompt " * 12, max_tokens=2, temperature=0
            )

    asyncio.run(twice())
    text, values = _metrics(cluster)
    assert 'prefix_serve_tenant_charged_tokens_total{tenant="batch"}' in text
    assert 'prefix_serve_tenant_charged_tokens_total{tenant="chat"}' in text
    assert (
        'prefix_serve_tenant_rejected_requests_total{reason="queue_timeout",tenant="batch"}' in text
    )
    assert 'prefix_serve_tenant_queue_wait_seconds_count{priority="5",tenant="chat"}' in text
    assert 'prefix_serve_tenant_express_requests_total{tenant="chat"} 1.0' in text
    assert 'prefix_serve_tenant_express_requests_total{tenant="batch"}' not in text
    assert 'prefix_serve_tenant_rejected_requests_total{reason="requests",tenant="metered"}' in text
    assert values['prefix_serve_tenant_ttft_seconds_count{tenant="chat"}'] >= 1
    prompt = {k.split('"')[1]: v for k, v in values.items() if "_tenant_prompt_tokens_total" in k}
    cached = {
        k.split('"')[1]: v for k, v in values.items() if "_tenant_cached_prompt_tokens_total" in k
    }
    assert all(cached[t] <= prompt[t] for t in cached)
    assert cached["chat"] >= 16  # the repeat hit at least one block
    assert 'prefix_serve_replica_tenant_cached_blocks{replica="' in text  # each pool's shares


def _replica_stats(cluster: ServeCluster) -> dict:
    (stats,) = cluster.stats()["replicas"].values()
    return stats


def _until(cluster: ServeCluster, check: Callable[[dict], bool], timeout_s: float = 15.0) -> dict:
    """The replica's stats once ``check`` holds (they are pushed every second)."""
    deadline = time.monotonic() + timeout_s
    while not check(stats := _replica_stats(cluster)):
        assert time.monotonic() < deadline, stats
        time.sleep(0.25)
    return stats


def test_a_sessions_blocks_are_kept_between_turns_and_released_on_its_last(
    cluster: ServeCluster,
) -> None:
    """A turn with ``cache_retention`` under ``x-session-id`` leaves its blocks held for the
    session; the next turn, sent with ``x-session-final``, hits them and they go when it
    ends. Retention without a session id keeps the blocks for their TTL alone: an idle
    replica releases them when it passes."""
    chat = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="sk-chat", max_retries=0)
    session = {"x-session-id": "agent-7"}
    turn = "Tools: search, open, edit. Task: fix the failing test. " * 4  # 224 tokens
    first = chat.completions.create(
        model=MODEL,
        prompt=turn,
        max_tokens=8,
        temperature=0,
        extra_headers=session,
        extra_body={"cache_retention": {"ttl_s": 60}, "ignore_eos": True},
    )
    held = _until(cluster, lambda s: s["sessions_retained"] == 1)
    assert held["blocks_pinned"] == (len(turn) + 7) // 16  # prompt and output's full blocks
    second = chat.completions.create(
        model=MODEL,
        prompt=turn + first.choices[0].text + " Tool result: 3 passed.",
        max_tokens=8,
        temperature=0,
        extra_headers={**session, "x-session-final": "true"},
    )
    assert second.usage.prompt_tokens_details.cached_tokens >= len(turn) // 16 * 16
    _until(cluster, lambda s: s["sessions_retained"] == 0 and s["blocks_pinned"] == 0)
    chat.completions.create(
        model=MODEL,
        prompt=turn,
        max_tokens=1,
        extra_body={"cache_retention": {"ttl_s": 2}, "ignore_eos": True},
    )
    _until(cluster, lambda s: s["sessions_retained"] == 1)
    _until(cluster, lambda s: s["sessions_retained"] == 0 and s["retention_expired"] == 1)
