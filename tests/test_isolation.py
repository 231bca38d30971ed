"""A cluster of the suite's own, on a Ray of its own, with pulls on (``replica.pull``):

* a pulled prefix: a long prompt served on one replica, then the same prefix on the other
  (round robin sends it there), which pulls the blocks from the first and hits them, out
  of the holder's shared pool (both replicas are on this node);
* a holder SIGKILLed before the other replica pulls from it (the index still lists it):
  the pull gives up at its deadline, the prefix is recomputed, the answer is the same and
  the survivor's block accounting adds up;
* a holder SIGKILLed while the other replica's pull waits on it (frozen first, so the
  pull is in flight): the pull fails by its deadline, the answer is the same;
* isolation: a Ray started on the machine by someone else is neither joined nor stopped.
  The outside cluster is started as a user starts one (``ray start --head``), in a
  temporary folder this module makes the machine's default (``RAY_TMPDIR``, where ``ray``
  and ``serve run`` look for a running cluster), so that a harness that joined "the local
  cluster" would find it. After the suite's cluster started, served and stopped, the outside
  cluster's processes are the very same ones, alive, and it runs no Serve application.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from chat_prompts import encode
from conftest import tiny
from streams import replica_pids

from bench.harness import redis_server
from bench.harness.launcher import ServeCluster
from bench.harness.private_ray import PrivateRay
from bench.harness.redis_server import LocalRedis, free_ports, quiet_ports
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from kvindex.reader import IndexReader
from replica.checkpoints import checkpoint_for
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig
from router.config import routing_config


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRay]:
    ray = PrivateRay(tmp_path_factory.mktemp("outside") / "ray.log").start({})
    STARTED.update(ray.pids())  # before the suite's cluster exists
    try:
        yield ray
    finally:
        ray.stop()


STARTED: set[int] = set()  # the outside cluster's processes as it started


@pytest.fixture(scope="module")
def cluster(outside: PrivateRay) -> Iterator[ServeCluster]:
    with pytest.MonkeyPatch.context() as patch, LocalRedis() as redis_server:
        patch.setenv("RAY_TMPDIR", str(outside.temp_dir))  # "the machine's" Ray
        args = ClusterArgs(
            num_replicas=2,
            replica_num_cpus=0.5,
            engine=tiny(num_threads=1, num_blocks=256, max_model_len=2048),
            routing=routing_config(policy="round_robin", stats_period_s=0.5),
            pull=PullConfig(enabled=True),
            # no node store: a replica whose node's store holds the prefix restores it
            # instead of pulling (``pull_source``), and these tests are about pulls
            store=StoreConfig(enabled=False),
            # a dead holder stays listed long enough that a puller tries it
            index=IndexConfig(url=redis_server.url, cluster="isolation", heartbeat_ttl_s=10),
        )
        with ServeCluster(args) as c:
            yield c


def chat(cluster: ServeCluster, system: str, question: str):
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama-6m",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
    )
    return raw.parse(), raw.headers["x-replica-id"]


def published(cluster: ServeCluster, system: str, question: str, holder: str) -> None:
    """Wait until the index lists the holder with every full block of the prompt (its
    publisher sends them after the step, in ms, later on a loaded machine): a puller that
    asks before then would find nothing to pull."""
    tokenizer = checkpoint_for(cluster.args.engine.model).tokenizer()
    chain = cluster.args.engine.block_hasher().chain(encode(tokenizer, system, question))
    watch = cluster.args.index.model_copy(update={"timeout_s": 2.0, "connect_timeout_s": 2.0})
    reader = IndexReader(watch, cluster.args.engine.model_id)

    def held() -> int:
        answer = reader.query(chain)
        state = answer.state_of(holder) if answer is not None else None
        return (state.cached_blocks or 0) if state is not None else 0

    deadline = time.monotonic() + 10
    try:
        while held() < len(chain):
            assert time.monotonic() < deadline, "the holder's blocks never reached the index"
            time.sleep(0.1)
    finally:
        reader.close()


def test_a_replica_pulls_the_prefix_another_holds(cluster: ServeCluster) -> None:
    system = "A long shared system prompt, computed once and pulled after. " * 20
    first, on_first = chat(cluster, system, "P1?")
    published(cluster, system, "P1?", on_first)
    second, on_second = chat(cluster, system, "P2?")
    assert on_first != on_second  # round robin
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= len(system)  # bytes: tokens
    assert second.choices[0].message.content is not None
    deadline = time.monotonic() + 10  # the puller's counters, a stats period later
    while not (stats := cluster.stats()["replicas"][on_second]).get("pulled_blocks"):
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    assert stats["pulls"] == 1 and stats["pulls_failed"] == 0
    assert stats["pulls_shared_memory"] == 1  # the same node: read from the holder's pool
    assert stats["pulled_blocks"] * 16 >= len(system) and stats["pull_blocks_refused"] == 0


def counter(cluster: ServeCluster, replica: str, name: str, above: int) -> int:
    """The replica's counter once it exceeds ``above`` (a stats period later), or its value
    after 10 s."""
    deadline = time.monotonic() + 10
    while (value := cluster.stats()["replicas"][replica].get(name) or 0) <= above:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return value


def test_a_holder_killed_before_the_pull_costs_a_failed_pull_and_a_recompute(
    cluster: ServeCluster,
) -> None:
    """The pull from the dead holder (still listed in the index) fails, counted, and costs
    no error: the prefix is recomputed, the answer is the same, the survivor audits its
    blocks clean once idle."""
    system = "Another long system prompt; its holder dies before anyone pulls it. " * 20
    first, holder = chat(cluster, system, "K?")
    published(cluster, system, "K?", holder)
    pids = replica_pids(cluster)
    (survivor,) = set(pids) - {holder}
    before = cluster.stats()["replicas"][survivor]
    failed = before.get("pulls_failed") or 0
    os.kill(pids[holder], signal.SIGKILL)
    second, served_on = chat(cluster, system, "K?")
    assert served_on == survivor
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens <= 32  # the template's head
    assert counter(cluster, survivor, "pulls_failed", failed) == failed + 1
    audits = before["idle_audits"]  # the survivor's audits before the second request
    assert counter(cluster, survivor, "idle_audits", audits) > audits  # idle since
    assert cluster.stats()["replicas"][survivor]["audit_error"] is None


def live_replica_pids(cluster: ServeCluster) -> dict[str, int]:
    """Both replicas' process ids once both are alive (Serve replaces a killed one)."""
    deadline = time.monotonic() + 90
    while True:
        pids = replica_pids(cluster)
        try:
            for pid in pids.values():
                os.kill(pid, 0)
            return pids
        except ProcessLookupError:
            assert time.monotonic() < deadline, pids
            time.sleep(0.5)


def test_a_holder_killed_mid_pull_fails_the_pull_by_its_deadline_and_the_answer_stands(
    cluster: ServeCluster,
) -> None:
    """The holder is frozen (SIGSTOP) once it has published, so the other replica's pull
    waits on it; it is SIGKILLed while the pull waits. The pull fails (counted), the prompt
    is still served with the same greedy answer, and the pull waited no longer than its
    deadline for the dead holder. The deadline is judged by the survivor's own count of the
    seconds failed pulls waited, not by the request's latency: after the pull, the prefix's
    recompute shares 2 cores with Serve starting the holder's replacement, and on a slow host
    that took 3.3 s (a CI run)."""
    pids = live_replica_pids(cluster)
    # a dozen blocks: enough to pull (``min_blocks``), short enough that its recompute on a
    # survivor sharing 2 cores with Serve's replacement of the holder stays well under 3 s
    system = "A third system prompt; its holder dies while it is pulled. " * 3
    first, holder = chat(cluster, system, "M?")
    published(cluster, system, "M?", holder)
    (survivor,) = set(pids) - {holder}
    before = cluster.stats()["replicas"][survivor]
    failed = before.get("pulls_failed") or 0
    waited = before.get("failed_pull_seconds") or 0.0
    os.kill(pids[holder], signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(chat, cluster, system, "M?")
            time.sleep(0.5)  # the survivor's pull is waiting on the frozen holder
            os.kill(pids[holder], signal.SIGKILL)
            second, served_on = pending.result(timeout=60)  # nothing waits forever
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[holder], signal.SIGKILL)
    assert served_on == survivor
    assert second.choices[0].message.content == first.choices[0].message.content
    assert counter(cluster, survivor, "pulls_failed", failed) == failed + 1
    stats = cluster.stats()["replicas"][survivor]  # the failed pull's counters, together
    pull_waited = stats["failed_pull_seconds"] - waited
    # it waited on the frozen holder, and no longer than its deadline (plus the event loop's
    # slack on a loaded host)
    assert 0 < pull_waited < PullConfig().timeout_s + 0.5, pull_waited
    assert cluster.stats()["replicas"][survivor]["audit_error"] is None


def test_a_ray_started_outside_the_suite_is_left_alone(
    outside: PrivateRay, cluster: ServeCluster
) -> None:
    own = set(cluster.ray_pids())
    assert STARTED and own and not own & STARTED
    assert set(outside.pids()) == STARTED  # nothing of the suite's cluster started in it
    cluster.stop()
    assert set(outside.pids()) == STARTED  # and stopping it stopped nothing of the outside
    ray = str(Path(sys.executable).with_name("ray"))
    address = outside.env["RAY_ADDRESS"]
    status = subprocess.run(
        [ray, "status", f"--address={address}"], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stdout + status.stderr


def test_ports_are_chosen_where_no_process_is_handed_one_unasked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster's ports (Ray's, Serve's proxy, Redis) come from above Ray's worker ports and
    below the system's ephemeral range, so that no process binding port 0 or connecting out
    takes one between the choice and its owner's bind (Serve's proxy once failed to bind its
    port, chosen by ``bind(0)`` seconds earlier, and a module's cluster did not start)."""
    quiet = quiet_ports()
    assert quiet.start == 20_000 and len(quiet) > 1000
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(p in quiet for p in ports)
    with socket.socket() as taken:  # a port in use is never chosen, even drawn first
        taken.bind(("127.0.0.1", ports[0]))
        monkeypatch.setattr(redis_server.random, "sample", lambda _, k: ports[: min(k, 8)])
        assert free_ports(3) == ports[1:4]
