"""Hostile input on the real cluster: fuzzing, edge-case prompts, tenant isolation, API keys.

One cluster with an API key and a cluster secret (keyed block hashes). Every test ends with
the cluster still serving; the last one checks that no block leaked on any replica.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from conftest import keep_logs, tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_e2e import assert_no_leaked_blocks

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.reader import IndexReader
from replica.checkpoints.tokenizer import ByteTokenizer
from router.config import routing_config

MODEL = "tiny-llama-6m"
KEY = "sk-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
ENGINE = tiny(num_threads=1, num_blocks=512, max_model_len=1024, hash_secret="s3cret")
MAX_TOKENS_LIMIT = 64


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[ServeCluster]:
    args = ClusterArgs(
        engine=ENGINE,
        max_tokens_limit=MAX_TOKENS_LIMIT,
        api_keys=[KEY, "sk-second-key"],
        routing=routing_config(stats_period_s=0.5),
        index=IndexConfig(url=redis_server.url, cluster="reliability"),
    )
    failed = request.session.testsfailed
    c = ServeCluster(args).start()
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


@pytest.fixture(scope="module")
def http(cluster: ServeCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.base_url, headers=AUTH, timeout=60) as client:
        yield client


def assert_openai_error(resp: httpx.Response, status: int | None = None) -> dict:
    if status is not None:
        assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in resp.text
    return body["error"]


def test_api_keys_guard_everything_but_the_probes(cluster: ServeCluster) -> None:
    url = cluster.base_url
    assert httpx.get(f"{url}/health").status_code == 200
    ready = httpx.get(f"{url}/ready")  # a probe carries no key
    assert ready.status_code == 200 and ready.json()["ready"], ready.text
    assert ready.json()["engine_replicas"] == ready.json()["wanted_replicas"]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        for method, path in (
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("GET", "/cluster/stats"),
        ):
            resp = httpx.request(method, url + path, json=body, headers=headers)
            assert assert_openai_error(resp, 401)["code"] == "invalid_api_key"
    # auth comes before validation: a malformed body without a key is still a 401
    assert httpx.post(f"{url}/v1/completions", content=b"{").status_code == 401
    for key in (KEY, "sk-second-key"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
FIELDS = {
    "model": st.just(MODEL) | JSON_VALUES,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 300), max_size=8) | JSON_VALUES,
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                "content": st.text(max_size=40) | JSON_VALUES,
            }
        ),
        max_size=3,
    )
    | JSON_VALUES,
    "max_tokens": st.integers(-3, 6) | st.integers(10**3, 10**15) | JSON_VALUES,
    "temperature": st.floats(-1, 3, allow_nan=False) | st.floats(0, 1e-3) | JSON_VALUES,
    "top_p": st.floats(-1, 2, allow_nan=False) | st.floats(0, 1e-3) | JSON_VALUES,
    "n": st.integers(-1, 10**9) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=300), max_size=6) | JSON_VALUES,
    "seed": st.integers(-(2**70), 2**70) | JSON_VALUES,
    "cache_salt": st.text(max_size=300) | JSON_VALUES,
    "logprobs": JSON_VALUES,
}


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=st.fixed_dictionaries({}, optional=FIELDS) | JSON_VALUES,
)
def test_fuzzed_bodies_never_get_a_5xx_and_errors_are_openai_shaped(
    http: httpx.Client, path: str, body
) -> None:
    resp = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert resp.status_code in (200, 400, 404), (resp.status_code, resp.text[:300], body)
    if resp.status_code != 200:
        assert_openai_error(resp)
    elif isinstance(body, dict) and body.get("stream") is True:
        assert resp.text.rstrip().endswith("data: [DONE]")
    else:
        reply = resp.json()
        usage = reply["usage"]
        # usage adds up and follows the engine's rules: cached tokens in whole blocks, at
        # least one prompt token computed, at most max_tokens_limit tokens per choice
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached % ENGINE.block_size == 0 and cached < usage["prompt_tokens"]
        assert usage["completion_tokens"] <= MAX_TOKENS_LIMIT * len(reply["choices"])


@pytest.mark.parametrize(
    "raw",
    [b"", b"null", b"[]", b"\xff\xfe\x00", b'{"model": "' + b"a" * 100_000 + b'"}', b"{" * 5000],
)
def test_garbage_bytes_get_a_400(http: httpx.Client, raw: bytes) -> None:
    resp = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(resp, 400)


def test_hostile_prompts_get_clear_answers(http: httpx.Client) -> None:
    def complete(prompt, **extra) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}
        # json.dumps escapes lone surrogates (httpx's json= would refuse to send them)
        return http.post(
            "/v1/completions",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )

    room = ENGINE.max_model_len - 4 - 1  # the byte tokenizer adds BOS
    assert complete("a" * room).status_code == 200
    assert assert_openai_error(complete("a" * (room + 1)), 400)["code"] == "context_length_exceeded"
    assert complete("").status_code == 200  # BOS alone still runs
    for text in ("\u202eevil rtl\u202c", "e\u0301" * 50, "🧨" * 100, "\x00\x01\x7f", "\ud800x"):
        resp = complete(text)
        assert resp.status_code == 200, resp.text
    assert complete([0, 257, 256]).status_code == 200
    for ids in ([-1], [258], [2**31], [1.5], ["a", 1], [[1], "a"], [], [[]]):
        assert_openai_error(complete(ids), 400)
    assert_openai_error(complete("x", n=10**6), 400)
    assert_openai_error(complete("x", max_tokens=10**9), 400)
    assert_openai_error(complete("x", stop=["a"] * 100), 400)
    assert_openai_error(complete("x", stop="s" * 10_000), 400)
    ok = complete("x", stop=["\x00", "zz", "🧨", "e\u0301"], max_tokens=30)
    assert ok.status_code == 200


def test_salted_tenants_never_share_a_block(http: httpx.Client, redis_server: LocalRedis) -> None:
    prompt = "Tenant isolation check, a long shared system prompt. " * 12
    ids = ByteTokenizer().encode(prompt)
    hasher = ENGINE.block_hasher()
    index = IndexReader(IndexConfig(url=redis_server.url, cluster="reliability"), MODEL)

    def send(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        resp = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
        )
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def salt_of(salt: str | None) -> str:
        """What the engine is given: with API keys configured, the key's id leads every salt
        (README, per-key isolation), so two keys never share a block either."""
        key_id = hashlib.blake2b(KEY.encode(), digest_size=8).hexdigest()
        return f"key:{key_id}" + (f"/{salt}" if salt else "")

    assert send("tenant-a") == 0
    deadline = time.monotonic() + 10
    while not any((index.cached(hasher.chain(ids, salt_of("tenant-a"))) or {}).values()):
        # the replica's publisher thread sends its blocks after the step that cached them
        assert time.monotonic() < deadline, "tenant-a's blocks never reached the index"
        time.sleep(0.1)
    for other in ("tenant-b", None):
        assert set(index.cached(hasher.chain(ids, salt_of(other))).values()) == {0}
    for bare in ("tenant-a", None):  # the client's salt alone is not what was stored
        assert set(index.cached(hasher.chain(ids, bare)).values()) == {0}
    assert send("tenant-b") == 0 and send(None) == 0
    assert send("tenant-a") > 0
    # the keyed index never stores an unkeyed hash of what it served
    unkeyed = BlockHasher(ENGINE.block_size, MODEL)
    stored = set().union(*(index.replica_blocks(r) for r in index.live_replicas()))
    assert stored
    for salt in (None, "tenant-a", "tenant-b"):
        assert stored.isdisjoint(unkeyed.chain(ids, salt_of(salt)))
    keys = redis.Redis.from_url(redis_server.url).keys(b"*")
    assert not any(h in k for k in keys for h in unkeyed.chain(ids))


def test_clients_that_hang_up_mid_stream_leak_nothing(
    cluster: ServeCluster, http: httpx.Client
) -> None:
    aborted_before = sum(r.get("num_aborted", 0) for r in cluster.stats()["replicas"].values())
    body = {
        "model": MODEL,
        "prompt": "hang up on me " * 20,
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    for _ in range(4):
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")  # then the client goes away
    deadline = time.monotonic() + 20
    while sum(r.get("num_aborted", 0) for r in cluster.stats()["replicas"].values()) < (
        aborted_before + 4
    ):
        assert time.monotonic() < deadline, "the engine never aborted the abandoned requests"
        time.sleep(0.5)
    assert_no_leaked_blocks(cluster)  # this test alone (-k) checks its own leaks too


def test_nothing_leaked_after_all_of_it(cluster: ServeCluster, http: httpx.Client) -> None:
    """Every replica, once idle, audited its own block accounting and found it whole."""
    since = time.time()
    deadline = time.monotonic() + 30
    while True:
        replicas = cluster.stats()["replicas"]
        fresh = [r for r in replicas.values() if r.get("time", 0) > since + 1]
        if len(fresh) == 2 and all(r["num_running"] == r["blocks_in_use"] == 0 for r in fresh):
            break
        assert time.monotonic() < deadline, replicas
        time.sleep(0.5)
    for r in fresh:
        assert r["blocks_free"] + r["blocks_cached"] == r["blocks_total"]
        assert r["idle_audits"] > 0 and r["audit_error"] is None
    assert http.get("/health").status_code == 200
