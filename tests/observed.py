"""One cluster for the observability tests (``test_observe_*.py``): two replicas of the tiny
model, round robin (so a prefix often sits on the replica a request does not go to), pulls
of 8 blocks or more (so a long prefix is pulled and a short one recomputed), API keys on,
and every process exporting its traces to an OTLP receiver of the test's own.

The cluster is started by the first test that asks for it and stopped after the last test
in a row that uses it (``pytest_runtest_teardown`` below; this module is a plugin of
``conftest``), so the three modules share one start and the rest of the suite never runs
beside it."""

from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest
from conftest import tiny

from bench.harness.launcher import ServeCluster
from bench.harness.otlp_receiver import OTLPReceiver, tracing_env
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig
from router.config import routing_config

MODEL = "tiny-llama-6m"
KEY = "observe-key"
PULL_MIN_BLOCKS = 8


@dataclass
class Observed:
    cluster: ServeCluster
    receiver: OTLPReceiver
    redis: LocalRedis

    @property
    def base_url(self) -> str:
        return self.cluster.base_url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=KEY, max_retries=0)


def observed_args(redis: LocalRedis) -> ClusterArgs:
    return ClusterArgs(
        num_replicas=2,
        engine=tiny(num_threads=1, num_blocks=512),
        routing=routing_config(policy="round_robin", stats_period_s=0.5),
        index=IndexConfig(url=redis.url, cluster="observed"),
        pull=PullConfig(enabled=True, min_blocks=PULL_MIN_BLOCKS),
        store=StoreConfig(enabled=False),
        api_keys=[KEY],
    )


_running: Observed | None = None
_failed_before = 0


@pytest.fixture
def observed(request: pytest.FixtureRequest) -> Observed:
    """The observed cluster, started at the first test of a run of tests that use it."""
    global _running, _failed_before
    if _running is None:
        _failed_before = request.session.testsfailed
        redis = LocalRedis().start()
        receiver = OTLPReceiver().start()
        try:
            env = tracing_env(receiver.endpoint, delay_ms=200)  # every span within 0.2 s
            cluster = ServeCluster(observed_args(redis), env=env).start()
        except BaseException:
            receiver.stop()
            redis.close()
            raise
        _running = Observed(cluster, receiver, redis)
    return _running


def _stop(session: pytest.Session) -> None:
    global _running
    running, _running = _running, None
    if running is not None:
        running.cluster.stop(keep_logs=session.testsfailed > _failed_before)
        running.receiver.stop()
        running.redis.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or "observed" not in getattr(nextitem, "fixturenames", ()):
        _stop(item.session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop(session)
