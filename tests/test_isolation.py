"""Test clusters are theirs alone: a Ray started on the machine by someone else is neither
joined nor stopped by them.

The outside cluster here is started as a user starts one (``ray start --head``), in a
temporary folder this test then makes the machine's default (``RAY_TMPDIR``, where ``ray``
and ``serve run`` look for a running cluster), so that a harness that joined "the local
cluster" would find it. The suite's cluster starts, serves and stops; the outside cluster's
processes are then the very same ones, alive, and it runs no Serve application.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import tiny

from bench.harness.launcher import ServeCluster
from bench.harness.private_ray import PrivateRay
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig


@pytest.fixture()
def outside(tmp_path: Path) -> Iterator[PrivateRay]:
    ray = PrivateRay(tmp_path / "outside.log").start({})
    try:
        yield ray
    finally:
        ray.stop()


def test_a_ray_started_outside_the_suite_is_left_alone(
    outside: PrivateRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(outside.temp_dir))  # "the machine's" Ray
    before = set(outside.pids())
    assert before
    with LocalRedis() as redis_server:
        args = ClusterArgs(
            num_replicas=1,
            engine=tiny(num_threads=1, num_blocks=64),
            index=IndexConfig(url=redis_server.url, cluster="isolation"),
        )
        with ServeCluster(args) as cluster:
            reply = httpx.post(
                f"{cluster.base_url}/v1/completions",
                json={"model": "tiny-llama-6m", "prompt": "hi", "max_tokens": 2},
                timeout=60,
            )
            assert reply.status_code == 200
            own = set(cluster.ray_pids())
            assert own and not own & before
    assert set(outside.pids()) == before  # alive, and nothing started in it
    status = subprocess.run(
        [
            str(Path(sys.executable).with_name("ray")),
            "status",
            f"--address={outside.env['RAY_ADDRESS']}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stdout + status.stderr
