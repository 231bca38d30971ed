"""Streams moved off a live replica (``replica.moves``): by an operator's order, with a push
that fails, and off a replica Serve stops. Each client gets exactly the tokens and logprobs
(bitwise, in bfloat16) of a stream never moved, nothing missing and nothing twice, and
block accounting adds up on both replicas afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from conftest import keep_logs, tiny
from streams import Stream, busiest, chat_bodies, replica_pids, streams_with
from test_serve_e2e import assert_no_leaked_blocks

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from router.config import routing_config

MODEL = "tiny-llama-6m"
SYSTEM = "You log every train that passes the station, with its time and track. " * 3
SAMPLING = [
    {"temperature": 0.0},
    {"temperature": 0.0},
    {"temperature": 0.9, "top_p": 0.95, "seed": 11},
    {"temperature": 1.1, "seed": 12},
]


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[ServeCluster]:
    failed = request.session.testsfailed
    args = ClusterArgs(
        num_replicas=2,
        max_ongoing_requests=16,
        engine=tiny(num_threads=1, num_blocks=512, dtype="bfloat16", deterministic=True),
        routing=routing_config(stats_period_s=0.5),
        index=IndexConfig(url=redis_server.url, cluster="moves"),
    )
    c = ServeCluster(args, dashboard=True).start()  # scale-in: `serve deploy` needs it
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


def bodies(tag: str) -> list[dict]:
    questions = [f"Train {tag}{i}?" for i in range(len(SAMPLING))]
    return chat_bodies(
        MODEL, SYSTEM, questions, SAMPLING, max_tokens=400, logprobs=True, top_logprobs=2
    )


def run(
    cluster: ServeCluster, tag: str, act: Callable[[list[Stream]], None] | None = None
) -> list[Stream]:
    """Every body at once; ``act(streams)`` once each has 5 pieces (mid-decode)."""
    return streams_with(cluster, bodies(tag), act)


def assert_same(got: list[Stream], want: list[Stream]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.errors == []
        assert g.text == w.text  # nothing missing, nothing twice
        assert g.logprobs == w.logprobs  # every token's logprob and top 2, bitwise
        assert g.usage is not None and w.usage is not None
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert g.usage[key] == w.usage[key]  # every output token counted once


def moved(cluster: ServeCluster, reason: str, outcome: str) -> float:
    text = httpx.get(f"{cluster.base_url}/metrics").text
    label = f'outcome="{outcome}",reason="{reason}"'
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("prefix_serve_moved_requests_total") and label in line
    )


def order(cluster: ServeCluster, replica: str, **params: object) -> dict:
    url = f"{cluster.base_url}/cluster/replicas/{replica}/moves"
    resp = httpx.post(url, params=params, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_streams_moved_by_an_order_go_on_token_for_token(cluster: ServeCluster) -> None:
    reference = run(cluster, "a")
    assert all(s.usage and s.usage["completion_tokens"] == 400 for s in reference)
    pids = replica_pids(cluster)
    before = moved(cluster, "operator", "pushed")
    answers: list[dict] = []

    def move(streams: list[Stream]) -> None:
        source = busiest(streams)
        (other,) = set(pids) - {source}
        answers.append(order(cluster, source, to=other))
        answers[0]["to"] = other

    streams = run(cluster, "a", move)
    assert_same(streams, reference)
    (answer,) = answers
    on_source = [s for s in streams if s.replica == answer["replica_id"]]
    assert len(answer["moves"]) == len(on_source) >= 2  # most streams were there, all moved
    for m in answer["moves"]:
        assert m["target"] == answer["to"] and m["reason"] == "operator"
        assert m["tokens"] >= 5 * 16 and m["num_bytes"] > 0  # the prompt's KV went with it
    assert moved(cluster, "operator", "pushed") - before == len(on_source)

    def taken() -> int:
        return cluster.stats()["replicas"][answer["to"]].get("moves_received", 0)

    deadline = time.monotonic() + 10  # the stats a period behind
    while taken() < len(on_source):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert_no_leaked_blocks(cluster, timeout_s=60)


def test_a_move_whose_push_fails_is_recomputed_token_for_token(cluster: ServeCluster) -> None:
    reference = run(cluster, "b")
    before = moved(cluster, "operator", "recomputed")
    answers: list[dict] = []

    def move(streams: list[Stream]) -> None:  # no push can be taken in a microsecond
        answers.append(order(cluster, busiest(streams), push_timeout_s=1e-6))

    streams = run(cluster, "b", move)
    assert_same(streams, reference)
    (answer,) = answers
    assert answer["moves"] and all(m["target"] is None for m in answer["moves"])
    assert moved(cluster, "operator", "recomputed") - before == len(answer["moves"])
    source = cluster.stats()["replicas"][answer["replica_id"]]
    assert source["moves_failed"] >= len(answer["moves"])
    assert_no_leaked_blocks(cluster, timeout_s=60)


def test_an_order_for_no_replica_is_a_404_and_to_itself_a_400(cluster: ServeCluster) -> None:
    resp = httpx.post(f"{cluster.base_url}/cluster/replicas/nobody/moves", timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "replica_id"
    (one, *_) = replica_pids(cluster)
    resp = httpx.post(f"{cluster.base_url}/cluster/replicas/{one}/moves?to={one}", timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "to"


def test_a_replica_serve_stops_moves_its_streams_and_hot_prefixes(cluster: ServeCluster) -> None:
    """Scale-in mid-decode (last: the cluster keeps one replica). Serve picks which replica
    stops; every stream on it moves at once and the survivor takes its hot prefixes."""
    reference = run(cluster, "c")
    before = {o: moved(cluster, "leaving", o) for o in ("pushed", "recomputed")}
    received = {rid: r.get("moves_received", 0) for rid, r in cluster.stats()["replicas"].items()}
    streams = run(cluster, "c", lambda _: cluster.scale(1))
    assert_same(streams, reference)
    deadline = time.monotonic() + 60
    while len(cluster.stats()["replicas"]) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    ((survivor, stats),) = cluster.stats()["replicas"].items()
    left = [s for s in streams if s.replica != survivor]
    pushed = moved(cluster, "leaving", "pushed") - before["pushed"]
    assert pushed + moved(cluster, "leaving", "recomputed") - before["recomputed"] == len(left)
    assert pushed == len(left)  # the survivor took every stream's KV
    # and at least one hot prefix besides (the leaver cached each stream's prompt)
    assert stats["moves_received"] - received[survivor] >= len(left) + (len(left) > 0)
