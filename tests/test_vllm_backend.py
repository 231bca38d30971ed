"""The vLLM backend end to end: a real cluster (``serve run`` from vLLM's virtualenv, 2 vLLM
CPU engines of SmolLM2 from its Hugging Face folder, a real redis-server), driven by the
``openai`` SDK from this interpreter.

Every check compares the index (our hashes, read from Redis) with what vLLM itself reports:
a request's ``cached_tokens`` is vLLM's own count of prompt tokens it served from its cache,
so "the index predicted k blocks on the replica that served it, and vLLM served k blocks"
holds only if the bridge's view of vLLM's cache is exact. The cluster runs with KV event
batches thrown away on arrival (``PREFIX_SERVE_TEST_DROP_KV_EVENTS``), as a full ZMQ queue
would: the subscriber must notice and replay them, and every check must hold anyway.

``make test`` installs the virtualenv and writes the folder (``make install-vllm``) and
names both in ``PREFIX_SERVE_VLLM_PYTHON`` / ``PREFIX_SERVE_HF_MODEL``.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import keep_logs, vllm_paths

from bench.harness.launcher import ServeCluster
from bench.harness.memory import shm_sweep
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.hashing import BlockHasher
from kvindex.reader import IndexReader
from replica.vllm_replica import DROP_EVENTS_ENV

MODEL = "smollm2-vllm"
BLOCK = 32
NUM_BLOCKS = 48  # per replica: 1,536 tokens, so the tests below evict
DROPPED = (2, 5, 11)  # event batches each replica's subscriber throws away on arrival
VOCAB = range(1000, 20000)  # ordinary tokens of SmolLM2's vocabulary (no special ones)


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[ServeCluster]:
    python, folder = vllm_paths()
    args = ClusterArgs.model_validate(
        {
            "num_replicas": 2,
            "replica_num_cpus": 0.5,
            "engine": {
                "backend": "vllm",
                "model": str(folder),
                "model_id": MODEL,
                "dtype": "float32",
                "block_size": BLOCK,
                "num_blocks": NUM_BLOCKS,
                "max_model_len": 1024,
            },
            "index": {"url": redis_server.url, "cluster": "vllm-backend"},
            "store": {"enabled": False},
            "max_tokens_limit": 64,
        }
    )
    os.environ[DROP_EVENTS_ENV] = ",".join(map(str, DROPPED))
    failed = request.session.testsfailed
    try:
        # a replica killed on purpose (below) leaves its vLLM's message queues in /dev/shm
        # (vLLM's engine core unlinks them only at a clean exit): removed once it stops
        with shm_sweep(), ServeCluster(args, python=python) as running:
            yield running
            keep = keep_logs(request, failed)
            running.stop(keep_logs=keep)
    finally:
        os.environ.pop(DROP_EVENTS_ENV, None)


@pytest.fixture(scope="module")
def client(cluster: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0)


def hasher() -> BlockHasher:
    return BlockHasher(BLOCK, MODEL)


def complete(client: openai.OpenAI, prompt: list[int], max_tokens: int = 1) -> tuple[str, int]:
    """Serve ``prompt`` (token ids); the replica that served it and vLLM's cached tokens."""
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    usage = raw.parse().usage
    details = usage.prompt_tokens_details if usage else None
    return raw.headers["x-replica-id"], (details.cached_tokens or 0) if details else 0


def settle(cluster: ServeCluster, timeout_s: float = 30.0) -> None:
    """Wait until every replica's index entry has caught up with its vLLM."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        replicas = cluster.stats()["replicas"]
        if len(replicas) == 2 and all(
            r.get("index_in_sync") and r.get("in_flight") == 0 for r in replicas.values()
        ):
            # past one idle probe of the subscriber (1 s: it replays what it may have missed)
            time.sleep(1.3)
            return
        time.sleep(0.2)
    raise TimeoutError("replicas' index entries did not settle")


def leading(chain: list[bytes], held: set[bytes]) -> int:
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


def probe(client: openai.OpenAI, cluster: ServeCluster, prompt: list[int]) -> tuple[int, int]:
    """(blocks the index says the serving replica held, blocks vLLM served from cache)."""
    settle(cluster)
    index = IndexReader(cluster.args.index, MODEL)
    try:
        held = {r: index.replica_blocks(r) for r in index.live_replicas()}
    finally:
        index.close()
    chain = hasher().chain(prompt)
    replica, cached = complete(client, prompt)
    usable = (len(prompt) - 1) // BLOCK  # vLLM always computes a prompt's last token
    return min(leading(chain, held.get(replica, set())), usable), cached // BLOCK


def random_prompt(rng: random.Random, blocks: int, tail: int = 0) -> list[int]:
    return [rng.choice(VOCAB) for _ in range(blocks * BLOCK + tail)]


def test_a_served_prompt_is_in_the_index_under_our_hashes(
    cluster: ServeCluster, client: openai.OpenAI
) -> None:
    """vLLM's blocks of a prompt appear in the index as our chain of it, on the replica
    that served it, and the router's chain of the same prompt finds them."""
    prompt = random_prompt(random.Random(1), 6, tail=7)
    replica, cached = complete(client, prompt)
    assert cached == 0
    settle(cluster)
    chain = hasher().chain(prompt)
    index = IndexReader(cluster.args.index, MODEL)
    try:
        assert set(chain) <= index.replica_blocks(replica)
        holders = {r: n for r, n in (index.cached(chain) or {}).items() if n}
        assert holders == {replica: 6}  # the other replica: none
    finally:
        index.close()
    again, cached = complete(client, prompt)
    assert (again, cached) == (replica, 6 * BLOCK)  # routed there, served from its cache


def test_a_random_trace_leaves_the_index_equal_to_vllms_cache(
    cluster: ServeCluster, client: openai.OpenAI
) -> None:
    """200 requests (shared prefixes, evictions, dropped event batches), 4 at a time (each
    engine batches, and its events come in bursts), then every probe's hit as the index
    predicts it is the hit vLLM reports."""
    rng = random.Random(7)
    prefixes = [random_prompt(rng, rng.randint(2, 8)) for _ in range(10)]
    trace = [
        (rng.choice(prefixes) + random_prompt(rng, 0, tail=rng.randint(1, 60)), rng.randint(1, 4))
        for _ in range(200)
    ]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda sent: complete(client, *sent), trace))
    stats = cluster.stats()["replicas"].values()
    assert sum(r["evictions"] for r in stats) > 0  # the pools were too small to keep all
    assert sum(r["kv_events_gaps"] for r in stats) >= 1  # the dropped batches were noticed
    assert all(r["kv_events_lost"] == 0 for r in stats)  # and replayed, not given up on
    probes = [(p + random_prompt(rng, 0, tail=5)) for p in prefixes * 2]
    results = [probe(client, cluster, p) for p in probes]
    assert [index for index, _ in results] == [vllm for _, vllm in results]
    assert any(vllm for _, vllm in results)


def test_evicted_blocks_leave_the_index(cluster: ServeCluster, client: openai.OpenAI) -> None:
    """A replica's index entry never holds more blocks than its pool, and a prompt whose
    blocks were pushed out by others is predicted (and served) as a miss."""
    rng = random.Random(3)
    first = random_prompt(rng, 10, tail=3)
    complete(client, first)
    for _ in range(8):  # 8 x 10 blocks over 2 pools of 48
        complete(client, random_prompt(rng, 10, tail=3))
    settle(cluster)
    index = IndexReader(cluster.args.index, MODEL)
    try:
        sizes = [len(index.replica_blocks(r)) for r in index.live_replicas()]
    finally:
        index.close()
    assert sizes and max(sizes) <= NUM_BLOCKS
    predicted, served = probe(client, cluster, first)
    assert predicted == served


def test_a_killed_replica_leaves_the_index_and_its_stream_resumes(
    cluster: ServeCluster, client: openai.OpenAI
) -> None:
    """SIGKILL (no destructor runs) of the replica streaming a request: the client's stream
    goes on from the other replica (prompt + delivered tokens re-sent: the whole count, one
    finish, no error; not token-exact on vLLM, so the text is not compared), its heartbeat
    lapses and the index drops it and its blocks; the other replica serves on."""
    prompt = random_prompt(random.Random(9), 2)
    with client.completions.with_streaming_response.create(
        model=MODEL, prompt=prompt, max_tokens=64, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ) as response:  # fmt: skip
        victim = response.headers["x-replica-id"]
        chunks = response.parse()
        pieces = [next(chunks) for _ in range(3)]  # mid-stream: 3 tokens delivered
        os.kill(cluster.stats()["replicas"][victim]["pid"], signal.SIGKILL)
        pieces += list(chunks)
    finishes = [c.choices[0].finish_reason for c in pieces if c.choices]
    assert [f for f in finishes if f] == ["length"]
    usage = pieces[-1].usage
    assert usage is not None and usage.completion_tokens == 64
    index = IndexReader(cluster.args.index, MODEL)
    try:
        deadline = time.monotonic() + 60  # the heartbeat TTL, then the next reap purges it

        def gone() -> bool:
            return victim not in index.live_replicas() and not index.replica_blocks(victim)

        while not gone() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert victim not in index.live_replicas()
        assert index.replica_blocks(victim) == set()
    finally:
        index.close()
    replica, _ = complete(client, random_prompt(random.Random(5), 2), max_tokens=2)
    assert replica != victim
