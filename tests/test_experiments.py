"""The experiment commands run and print their JSON contract (tiny sizes; no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cluster.experiments.redis_server import LocalRedis

REPO = Path(__file__).resolve().parent.parent


def run_experiment(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.experiments", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_benchmark_prints_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    result = run_experiment(
        "engine",
        "--trace",
        "chat",
        "--requests",
        "6",
        "--rate",
        "50",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    assert json.loads(out.read_text()) == result
    assert result["trace"] == "chat"
    keys = {
        "requests",
        "prompt_tokens",
        "cached_prompt_tokens",
        "hit_rate",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "output_tokens_per_s",
        "duration_s",
    }
    for mode in ("cache_off", "cache_on"):
        assert keys <= set(result[mode])
        assert result[mode]["requests"] == 6
    assert result["cache_off"]["hit_rate"] == 0.0
    assert result["cache_on"]["hit_rate"] > 0.5
    assert result["conditions"]["hash_4096_tokens_ms"] > 0


def test_index_benchmark_against_a_given_redis(redis_server: LocalRedis) -> None:
    result = run_experiment(
        "index", "--redis-url", redis_server.url, "--blocks", "4000", "--queries", "50"
    )
    assert result["blocks_indexed"] == 4000
    assert len(result["answer"]) == 8
    assert sorted(result["answer"].values()) == [0, 32, 64, 96, 128, 160, 192, 224]
    assert result["query_p99_ms"] > 0 and result["memory_bytes_per_block"] > 0
