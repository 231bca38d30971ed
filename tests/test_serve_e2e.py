"""End to end: `serve run` with real Ray Serve replicas, real Redis, the official openai SDK."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from conftest import keep_logs, tiny
from streams import replica_pids

from bench.harness.launcher import ServeCluster, cluster_env
from bench.harness.private_ray import PrivateRay
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs, FairQueueConfig
from kvindex.config import IndexConfig
from kvindex.reader import IndexReader
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig
from router.config import routing_config

MODEL = "tiny-llama-6m"
SYSTEM = "You are a careful assistant for a shipping company. " * 12  # ~640 tokens


def cluster_args(redis_url: str, policy: str, **overrides) -> ClusterArgs:
    return ClusterArgs(
        num_replicas=2,
        replica_num_cpus=0.5,
        ingress_num_cpus=0.1,
        max_ongoing_requests=4,
        max_queued_requests=4,
        engine=tiny(num_threads=1, num_blocks=512, max_model_len=2048),
        routing=routing_config(policy=policy, stats_period_s=0.5),
        index=IndexConfig(url=redis_url, cluster="e2e"),
        **overrides,
    )


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="module")
def ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRay]:
    """One private Ray for the module's clusters, one after another (~7 s of start and
    stop saved per cluster; each ``serve run`` shuts its own application down)."""
    log = tmp_path_factory.mktemp("e2e-ray") / "ray.log"
    instance = PrivateRay(log, dashboard=False).start(cluster_env())
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="module")
def cluster(
    redis_server: LocalRedis, ray: PrivateRay, request: pytest.FixtureRequest
) -> Iterator[ServeCluster]:
    failed = request.session.testsfailed
    c = ServeCluster(cluster_args(redis_server.url, "prefill_cost"), ray=ray).start()
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


@pytest.fixture(scope="module")
def client(cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, system: str, question: str, max_tokens: int = 8, **kw):
    """A greedy chat request; returns (completion, replica id)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **kw.pop("extra_body", {})},
        **kw,
    )
    return raw.parse(), raw.headers["x-replica-id"]


def test_chat_and_completions_stream_and_agree_with_non_streaming(client: openai.OpenAI) -> None:
    whole, _ = chat(client, "Be brief.", "Name a colour.", max_tokens=12)
    assert whole.object == "chat.completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 0

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
        ],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: same tokens either way
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    # the same prompt again: all of it that may be cached (whole blocks, one token left to
    # run) on the replica that served it, none on the other
    usable = (usage.prompt_tokens - 1) // 16 * 16
    assert usage.prompt_tokens_details.cached_tokens in (0, usable)

    done = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0)
    assert done.object == "text_completion" and done.usage.completion_tokens <= 6
    streamed = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[256, 79, 110, 99, 101], max_tokens=3)
    assert by_ids.usage.prompt_tokens == 5


def test_a_second_request_with_the_same_system_prompt_is_served_from_cache(
    client: openai.OpenAI,
) -> None:
    system = SYSTEM + "Policy 17."
    first, r1 = chat(client, system, "Where is my parcel?")
    second, r2 = chat(client, system, "Can I change the address?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.8 * len(system) and cached % 16 == 0
    assert r1 == r2


def test_shared_system_prompts_stick_together_and_distinct_ones_spread(
    client: openai.OpenAI,
) -> None:
    system = SYSTEM + "Tenant A."
    replicas = {chat(client, system, f"Question {i}?")[1] for i in range(6)}
    assert len(replicas) == 1
    spread = {chat(client, f"System prompt number {i}. " * 8, "Hi?")[1] for i in range(12)}
    assert len(spread) == 2


def test_cache_salt_isolates_tenants(client: openai.OpenAI, cluster: ServeCluster) -> None:
    system = "A system prompt no test sent before, salted or not. " * 12
    chat(client, system, "One?", extra_body={"cache_salt": "tenant-a"})
    other, _ = chat(client, system, "Two?", extra_body={"cache_salt": "tenant-b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    unsalted, _ = chat(client, system, "Three?")
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0
    again, _ = chat(client, system, "Four?", extra_headers={"x-cache-salt": "tenant-a"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0


LOOKBEHIND = {"type": "string", "pattern": "(?<=a)b"}  # refused by the replica's compiler
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def with_schema(schema: dict) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return {"model": MODEL, "response_format": fmt}


JSON_SCHEMA = with_schema({"type": "object"})
# what an error body must never show: a traceback, a file, an address, a Ray actor's id
LEAKS = re.compile(
    r"Traceback|\.py\b|\.cc\b|(?:/[\w.-]+){2,}|\b\d{1,3}(?:\.\d{1,3}){3}\b|[0-9a-f]{24,}|ray::|Actor"
)


def assert_no_leak(text: str) -> None:
    """An error body shows nothing of the server's insides (a 500's own request id aside)."""
    text = re.sub(r"as request [0-9a-f]+", "", text)
    assert LEAKS.search(text) is None, text


BAD_INPUTS = [
    ("/v1/chat/completions", b"{not json", 400, "json_invalid"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "role",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 2100}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 300]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        400,
        "max_tokens",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"1": 101}},
        400,
        "logit_bias",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"999": 1}},
        400,
        "token ids",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [258]}, 400, "token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 33}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1], []]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "x" * 2100]}, 400, "context_length"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model_not_found"),
    # formats and tools
    ("/v1/completions", {**JSON_SCHEMA, "prompt": "x", "min_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {**with_schema({"type": 5}), "prompt": "x"}, 400, "json_schema.schema"),
    ("/v1/completions", {**with_schema(LOOKBEHIND), "prompt": "x"}, 400, "Lookbehind"),
    ("/v1/completions", {**with_schema({"$ref": "#/$defs/a"}), "prompt": "x"}, 400, "response"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL, TOOL]}, 400, "unique"),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        400,
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": "x"}}}]},
        400,
        "tools[0].function.parameters",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, **JSON_SCHEMA, "tools": [TOOL], "tool_choice": "required"},
        400,
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "tool_calls": [CALL]}]},
        400,
        "only an assistant message has tool_calls",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "mentions"), BAD_INPUTS)
def test_bad_input_gets_an_openai_error_and_nothing_breaks(
    cluster: ServeCluster, client: openai.OpenAI, path: str, body, status: int, mentions: str
) -> None:
    url = cluster.base_url + path
    if isinstance(body, bytes):
        resp = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        resp = httpx.post(url, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert mentions in f"{error['message']} {error['param']} {error['code']}"
    assert_no_leak(resp.text)
    ok, _ = chat(client, "Still fine?", "Yes?", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_overload_is_shed_quickly_and_every_block_comes_back(cluster: ServeCluster) -> None:
    """Exactly 2 replicas x 4 slots + 4 queued = 12 admitted; the rest get 503 at the door,
    with ``retry-after``, and never reach an engine. Each admitted request generates 600
    tokens (seconds), so all 40 arrive while the first 12 are still running."""

    def finished() -> int:
        """Requests the engines finished, from stats each replica reported after this call
        (with nothing in flight, a fresh report counts every request so far)."""
        since = time.time()
        deadline = time.monotonic() + 20
        while True:
            replicas = cluster.stats()["replicas"].values()
            if len(replicas) == 2 and all(r.get("time", 0) > since for r in replicas):
                return sum(r["num_finished"] for r in replicas)
            assert time.monotonic() < deadline, "no fresh replica stats"
            time.sleep(0.2)

    assert_no_leaked_blocks(cluster)  # nothing in flight from earlier tests
    before = finished()
    with httpx.Client(base_url=cluster.base_url, timeout=180) as http:

        def call(i: int) -> httpx.Response:
            body = {"model": MODEL, "prompt": f"load {i} " * 40, "max_tokens": 600}
            return http.post("/v1/completions", json={**body, "ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            results = list(pool.map(call, range(40)))
    served = [r for r in results if r.status_code == 200]
    shed = [r for r in results if r.status_code == 503]
    assert (len(served), len(shed)) == (12, 28)
    for r in shed:
        assert r.json()["error"]["code"] == "overloaded"
        assert r.headers["retry-after"] == "1"
    assert all(r.json()["usage"]["completion_tokens"] == 600 for r in served)
    # refused at the door: the engines finished the 12 admitted requests and nothing else
    assert_no_leaked_blocks(cluster)
    assert finished() - before == 12


def assert_no_leaked_blocks(cluster: ServeCluster, timeout_s: float = 20.0) -> None:
    """Once idle, every replica's blocks are free or cached, none left in use, and every
    routing booking is released: the router's own and those in Redis."""
    deadline = time.monotonic() + timeout_s
    index = IndexReader(cluster.args.index, MODEL)
    while True:
        stats = cluster.stats()
        replicas = stats["replicas"]
        views = list(index.query([]) or [])
        idle = (
            len(replicas) == 2
            and all(
                "blocks_total" in r  # a replica reports once it has stats to report
                and r["blocks_in_use"] == 0
                and r["blocks_free"] + r["blocks_cached"] == r["blocks_total"]
                and r["num_running"] == r["num_waiting"] == 0
                for r in replicas.values()
            )
            and stats["bookings_in_flight"] == 0
            and all(v.in_flight == v.prefill_tokens == 0 for v in views)
        )
        if idle:
            return
        assert time.monotonic() < deadline, (stats, views)
        time.sleep(0.5)


def test_health_models_and_metrics(cluster: ServeCluster, client: openai.OpenAI) -> None:
    assert httpx.get(f"{cluster.base_url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat(client, SYSTEM, "metrics?")
    text = httpx.get(f"{cluster.base_url}/metrics").text
    for name in (
        "prefix_serve_ttft_seconds_bucket",
        "prefix_serve_prompt_tokens_total",
        "prefix_serve_cached_prompt_tokens_total",
        "prefix_serve_completion_tokens_total",
        "prefix_serve_routed_requests_total",
        "prefix_serve_routing_decision_seconds_bucket",
        "prefix_serve_replica_hit_rate",
        "prefix_serve_requests_total",
        "prefix_serve_index_answers_total",
        "prefix_serve_replica_blocks_free",
        "prefix_serve_replica_blocks_cached",
        "prefix_serve_replica_blocks_in_use",
        "prefix_serve_replica_store_spilled_blocks",  # the node store, on by default
        "prefix_serve_replica_store_restored_blocks",
        "prefix_serve_replica_pulls_failed",
    ):
        assert name in text, name
    stats = cluster.stats()
    assert stats["policy"] == "prefill_cost"
    assert sum(stats["routed"].values()) > 0


def test_serving_goes_on_with_affinity_while_redis_is_down(
    cluster: ServeCluster, client: openai.OpenAI, redis_server: LocalRedis
) -> None:
    redis_server.stop()
    try:
        ready = httpx.get(f"{cluster.base_url}/ready")  # ready, in a mode it states
        assert ready.status_code == 200, ready.text
        report = ready.json()
        assert report["indexed_replicas"] is None and report["engine_replicas"] == 2
        assert report["index"].startswith("the index is unreachable")
        system = SYSTEM + "Redis is down."
        replicas = {chat(client, system, f"Q{i}?")[1] for i in range(4)}
        assert len(replicas) == 1
        last, _ = chat(client, system, "Cached anyway?")
        assert last.usage.prompt_tokens_details.cached_tokens > 0  # the engine's own cache
    finally:
        redis_server.start()
    deadline = time.monotonic() + 20
    while not all(r.get("index_in_sync") for r in cluster.stats()["replicas"].values()):
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_a_body_over_the_cap_is_refused_before_it_is_read(cluster: ServeCluster) -> None:
    url = f"{cluster.base_url}/v1/completions"
    cap = cluster.args.max_request_bytes
    big = b'{"model": "x", "prompt": "' + b"a" * cap + b'"}'
    declared = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 2**16):
            yield big[i : i + 2**16]

    streamed = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "request_too_large" in streamed.text
    fine = httpx.post(url, json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert fine.status_code == 200


def test_round_robin_alternates(
    redis_server: LocalRedis, cluster: ServeCluster, ray: PrivateRay
) -> None:
    cluster.stop()  # one cluster at a time on two cores
    # a clean shutdown deregisters every replica and purges its blocks
    index = IndexReader(cluster.args.index, MODEL)
    assert index.live_replicas() == {}
    # nothing of a replica is left, only the namespace's log (kvindex.mirror); the routers'
    # shared bookings lapse a heartbeat TTL after their last share
    log = {f"{index.namespace}:{name}".encode() for name in ("ev", "evseq", "evid")}
    deadline = time.monotonic() + 2 * index.config.heartbeat_ttl_s + 1
    client = redis.Redis.from_url(redis_server.url)
    while left := set(client.keys(f"{index.namespace}*".encode())) - log:
        assert time.monotonic() < deadline, left
        time.sleep(0.2)
    # a heartbeat TTL far longer than the test waits, so that only a replica's own
    # deregistration (not expiry and reaping) can take it out of the index below
    patient = IndexConfig(url=redis_server.url, cluster="e2e", heartbeat_ttl_s=60.0)
    # with pulls: the second replica pulls the system prompt from the first, and so holds a
    # Serve handle to its own deployment when it gets SIGTERM below (as bytes through Ray's
    # object store, the path a replica once ignored SIGTERM on; tests/test_isolation.py
    # pulls through shared memory)
    # and no node store: a replica restores what its node's store holds instead of pulling
    # it (``pull_source``), and whether the first replica's blocks have spilled there when
    # the second request arrives is a race (one CI run saw no pull)
    update = {
        "index": patient,
        "pull": PullConfig(enabled=True, shared_memory=False),
        "store": StoreConfig(enabled=False),
    }
    args = cluster_args(redis_server.url, "round_robin").model_copy(update=update)
    with ServeCluster(args, ray=ray) as rr:
        rr_client = openai.OpenAI(base_url=f"{rr.base_url}/v1", api_key="x", max_retries=0)
        order = [chat(rr_client, SYSTEM, f"Q{i}?")[1] for i in range(6)]
        assert order[0] != order[1]
        assert order == [order[0], order[1]] * 3
        deadline = time.monotonic() + 10  # its counters, a stats period later
        while not rr.stats()["replicas"][order[1]].get("pulls"):
            assert time.monotonic() < deadline, rr.stats()["replicas"]
            time.sleep(0.2)
        # tenant isolation on one replica: round robin sends requests 1, 3 and 5 of these
        # to the same replica, so tenant-b's miss there is the salt's doing, not placement
        system = "Salted on one replica, a system prompt no one sent before. " * 8
        salted = [
            chat(rr_client, system, f"S{i}?", extra_body={"cache_salt": salt})
            for i, salt in enumerate(["tenant-a", "filler", "tenant-b", "filler", "tenant-a"])
        ]
        (first, ra), (b, rb), (again, ra2) = salted[0], salted[2], salted[4]
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert ra == rb == ra2
        assert b.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens >= 0.8 * len(system)
        # SIGTERM to a replica process (systemd stopping a unit, a pod's termination, `ray
        # stop`) deregisters it as its interpreter exits, like a graceful shutdown; one that
        # pulled too (a replica holding a Serve handle once stayed up: docs/decisions.md)
        old = set(index.live_replicas())
        assert len(old) == 2
        pids = replica_pids(rr)  # this cluster's replicas (from its stats), no one else's
        assert len(pids) == 2
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        store = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 20
        while old & set(index.live_replicas()) or any(
            store.exists(f"{index.namespace}:r:{rid}") for rid in old
        ):
            assert time.monotonic() < deadline, "a replica stopped by SIGTERM stayed registered"
            time.sleep(0.2)


def test_two_ingress_replicas_are_one_in_metrics_and_admission(
    redis_server: LocalRedis, cluster: ServeCluster, ray: PrivateRay
) -> None:
    """Two ingress replicas with mirrors: a scrape of either shows both, labelled by
    ingress, and summed they count every request (tests/test_admission.py holds their
    one admission cap). With the fair queue on, both join one shared queue in Redis
    (``cluster.shared_queue``): more requests at once than the engines' slots all finish,
    some of them after waiting in it, and no slot stays counted."""
    cluster.stop()  # one cluster at a time on two cores
    index = IndexConfig(url=redis_server.url, cluster="e2e-two", mirror=True)
    args = cluster_args(redis_server.url, "prefill_cost").model_copy(
        update={
            "index": index,
            "ingress_replicas": 2,
            "ingress_num_cpus": 0.05,
            "fair_queue": FairQueueConfig(enabled=True),
        }
    )
    with ServeCluster(args, ray=ray) as two:
        two_client = openai.OpenAI(base_url=f"{two.base_url}/v1", api_key="x", max_retries=0)
        # Serve's proxy picks an ingress per request, at random between two idle ones: send
        # until both have served one (8 at first; all 8 to one ingress is 1 run in 128)
        sent, deadline, per_ingress = 0, time.monotonic() + 60, {}
        while True:  # each ingress shares its metrics every 5 s
            if sent < 8 or (len(per_ingress) < 2 and sent < 32):
                for _ in range(8 if sent == 0 else 4):
                    chat(two_client, SYSTEM, f"two ingresses {sent}?")
                    sent += 1
            per_ingress = {}
            text = httpx.get(f"{two.base_url}/metrics").text
            for line in text.splitlines():
                if line.startswith("prefix_serve_requests_total{"):
                    ingress = re.search(r'ingress="([^"]+)"', line).group(1)
                    per_ingress[ingress] = per_ingress.get(ingress, 0) + float(line.split()[-1])
            if len(per_ingress) == 2 and sum(per_ingress.values()) == sent:
                break
            assert time.monotonic() < deadline, (sent, per_ingress)
            time.sleep(1)
        assert "prefix_serve_replica_blocks_free{replica=" in text  # unlabelled, not doubled
        _check_the_shared_queue(two_client, redis.Redis.from_url(redis_server.url))


def _check_the_shared_queue(client: openai.OpenAI, store: redis.Redis) -> None:
    """11 requests at once against 8 slots (2 replicas x 4) and 4 places in the queue."""
    ns = "ps:e2e-two:fq"
    waited_before = int(store.get(f"{ns}:arrivals") or 0)
    with concurrent.futures.ThreadPoolExecutor(11) as pool:
        answers = list(
            pool.map(lambda i: chat(client, SYSTEM, f"queued {i}?", max_tokens=64), range(11))
        )
    assert all(len(a.choices[0].message.content or "") for a, _ in answers)
    assert int(store.get(f"{ns}:arrivals") or 0) > waited_before  # some waited in Redis
    assert len(list(store.scan_iter(f"{ns}:alive:*"))) == 2  # both ingresses joined
    deadline = time.monotonic() + 5
    while store.hlen(f"{ns}:inf") or store.zcard(f"{ns}:wait"):  # ends are recorded async
        assert time.monotonic() < deadline, store.hgetall(f"{ns}:inf")
        time.sleep(0.1)
