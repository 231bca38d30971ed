"""Per-tenant quotas in a real redis-server (``cluster.quotas``), taken by two ``Quotas``
clients at once as two ingress replicas would: the limits hold across both, refusals are
OpenAI's 429 with its rate-limit headers, and what a request really cost is settled."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.harness.redis_server import LocalRedis
from cluster.api.errors import APIError
from cluster.quotas import Quotas
from cluster.tenants import Tenant, TenantLimits


def tenant(**limits: int) -> Tenant:
    return Tenant("t", limits=TenantLimits(**limits))


def test_tokens_per_minute_hold_across_two_ingresses(fresh_redis: LocalRedis) -> None:
    """Two clients take 10 tokens at a time, concurrently, from a 1,000-token bucket: what
    they got adds up to the limit plus what refilled meanwhile (1,000 / 60 s), no more."""
    limited = tenant(tokens_per_minute=1000)

    async def run() -> tuple[int, float]:
        ingresses = [Quotas(fresh_redis.url, "q1"), Quotas(fresh_redis.url, "q1")]
        start = time.monotonic()

        async def take(q: Quotas) -> int:
            try:
                await q.take(limited, 10)
                return 10
            except APIError as exc:
                assert exc.status == 429 and exc.code == "rate_limit_exceeded"
                return 0

        got = await asyncio.gather(*(take(ingresses[i % 2]) for i in range(300)))
        elapsed = time.monotonic() - start
        for q in ingresses:
            await q.close()
        return sum(got), elapsed

    granted, elapsed = asyncio.run(run())
    refill = 1000 * elapsed / 60
    assert 1000 <= granted <= 1000 + refill + 10, (granted, elapsed)
    assert granted <= 1010 + refill and granted / (1000 + refill) == pytest.approx(1, abs=0.01)


def test_a_refusal_says_which_limit_when_to_retry_and_what_remains(
    fresh_redis: LocalRedis,
) -> None:
    async def run() -> None:
        q = Quotas(fresh_redis.url, "q2")
        t = tenant(requests_per_minute=2, tokens_per_minute=600)
        taken = await q.take(t, 100)
        assert taken is not None
        assert taken.headers["x-ratelimit-limit-requests"] == "2"
        assert taken.headers["x-ratelimit-remaining-requests"] == "1"
        assert taken.headers["x-ratelimit-limit-tokens"] == "600"
        assert taken.headers["x-ratelimit-remaining-tokens"] == "500"
        assert taken.headers["x-ratelimit-reset-tokens"].endswith("s")
        with pytest.raises(APIError) as tokens:  # 500 left: 550 refused, both buckets kept
            await q.take(t, 550)
        assert tokens.value.status == 429 and tokens.value.type == "tokens"
        headers = tokens.value.headers or {}
        assert int(headers["retry-after"]) >= 5 and headers["x-ratelimit-remaining-requests"] == "1"
        await q.take(t, 10)
        with pytest.raises(APIError) as requests:
            await q.take(t, 10)
        assert requests.value.type == "requests" and "RPM" in requests.value.message
        with pytest.raises(APIError) as large:
            await q.take(tenant(tokens_per_minute=50), 80)
        assert "too large" in large.value.message
        await q.close()

    asyncio.run(run())


def test_settling_corrects_the_tokens_and_frees_the_place_in_flight(
    fresh_redis: LocalRedis,
) -> None:
    async def run() -> None:
        q = Quotas(fresh_redis.url, "q3")
        t = tenant(tokens_per_minute=1000, concurrent_requests=2)
        first = await q.take(t, 400)  # estimated at max_tokens: used far less
        second = await q.take(t, 400)
        assert first is not None and second is not None
        with pytest.raises(APIError) as busy:
            await q.take(t, 10)
        assert busy.value.type == "requests" and "in flight" in busy.value.message
        await q.settle(first, 100)  # 300 tokens back, its place freed
        third = await q.take(t, 10)
        assert third is not None
        remaining = int(third.headers["x-ratelimit-remaining-tokens"])
        assert 480 <= remaining <= 500  # 1000 - 100 - 400 - 10, and a little refill
        assert await q.take(tenant(), 10) is None  # no limits: nothing taken
        await q.close()

    asyncio.run(run())
