"""Shared fixtures: a real redis-server process per test module (started on a free port)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.harness.redis_server import LocalRedis


def keep_logs(request: pytest.FixtureRequest, failed_before: int) -> bool:
    """Whether a test failed since ``failed_before`` (then a fixture keeps its logs)."""
    return request.session.testsfailed > failed_before


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


@pytest.fixture
def fresh_redis(redis_server: LocalRedis) -> LocalRedis:
    """The module's server, started again if a test stopped it, and emptied."""
    if not redis_server.running:
        redis_server.start()
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server
