"""A replica dies mid-generation: every stream on it resumes on another replica, and each
client gets exactly the text and token count it gets without a failure."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import keep_logs
from test_serve_e2e import assert_no_leaked_blocks

from cluster.config import ClusterArgs
from cluster.experiments.launcher import ServeCluster
from cluster.experiments.redis_server import LocalRedis
from replica.config import EngineConfig
from replica.index import IndexConfig
from router.config import RoutingConfig

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
        engine=EngineConfig(num_threads=1, num_blocks=512),
        routing=RoutingConfig(stats_period_s=0.5),
        index=IndexConfig(url=redis_server.url, cluster="failover"),
    )
    c = ServeCluster(args).start()
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


class Stream(threading.Thread):
    """One streaming chat request, read chunk by chunk in its own thread."""

    def __init__(self, base_url: str, i: int) -> None:
        super().__init__(daemon=True)
        self.body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"City number {i}?"},
            ],
            "max_tokens": 600,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **REQUESTS[i],
        }
        self.url = f"{base_url}/v1/chat/completions"
        self.pieces: list[str] = []
        self.usage: dict | None = None
        self.replica = ""
        self.errors: list[dict] = []

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as resp:
            self.replica = resp.headers["x-replica-id"]
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                elif chunk.get("usage"):
                    self.usage = chunk["usage"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    self.pieces.append(chunk["choices"][0]["delta"]["content"])


def replica_pids(cluster: ServeCluster) -> dict[str, int]:
    """Every replica's process id, once Serve has pushed their stats (a stats period)."""
    deadline = time.monotonic() + 30
    while True:
        replicas = cluster.stats()["replicas"]
        if len(replicas) == 2 and all("pid" in r for r in replicas.values()):
            return {rid: r["pid"] for rid, r in replicas.items()}
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


def run_streams(cluster: ServeCluster, kill: bool) -> tuple[list[Stream], str | None]:
    pids = replica_pids(cluster)
    streams = [Stream(cluster.base_url, i) for i in range(len(REQUESTS))]
    for s in streams:
        s.start()
    victim = None
    if kill:
        deadline = time.monotonic() + 60
        while min(len(s.pieces) for s in streams) < 5:  # every stream is mid-generation
            assert time.monotonic() < deadline
            time.sleep(0.005)
        victim = max(set(pids), key=lambda rid: sum(s.replica == rid for s in streams))
        os.kill(pids[victim], signal.SIGKILL)
    for s in streams:
        s.join(120)
    return streams, victim


def resumed(cluster: ServeCluster) -> float:
    text = httpx.get(f"{cluster.base_url}/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("prefix_serve_resumed_requests_total") and "resumed" in line
    )


def test_streams_on_a_killed_replica_resume_token_for_token(cluster: ServeCluster) -> None:
    reference, _ = run_streams(cluster, kill=False)
    assert all(s.usage and s.usage["completion_tokens"] == 600 for s in reference)
    before = resumed(cluster)
    streams, victim = run_streams(cluster, kill=True)
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
