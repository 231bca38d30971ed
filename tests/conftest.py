"""Shared fixtures: a real redis-server process per test module (started on a free port), and
the engine config most tests run (the tiny random model in float32)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.harness.redis_server import LocalRedis
from replica.checkpoints import TINY_MODEL
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.engine.sequence import Sequence
from replica.engine.step import ScheduledBatch
from replica.messages import RequestOutput

# the observability tests' shared cluster (its fixture and the hooks that stop it)
pytest_plugins = ["observed"]


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


def tiny(**fields: Any) -> EngineConfig:
    """The tiny random model in float32 with a 512-token step budget (what the engine
    defaulted to before the defaults became the cluster's), overridden by ``fields``."""
    return EngineConfig(
        **{"model": TINY_MODEL, "dtype": "float32", "max_num_batched_tokens": 512, **fields}
    )


def vllm_paths() -> tuple[Path, Path]:
    """vLLM's interpreter and SmolLM2's Hugging Face folder, as ``make test`` names them."""
    python, folder = (
        os.environ.get("PREFIX_SERVE_VLLM_PYTHON"),
        os.environ.get("PREFIX_SERVE_HF_MODEL"),
    )
    if not (python and folder):
        pytest.fail("run through `make test` (it installs vLLM's virtualenv: make install-vllm)")
    return Path(python), Path(folder)


def run_to_end(engine: Engine, rid: str) -> RequestOutput:
    """Step ``engine`` until request ``rid`` finishes, checking its block accounting after
    every step; returns its last output."""
    while True:
        outputs = engine.step()
        engine.check_invariants()
        for out in outputs:
            if out.request_id == rid and out.finished:
                return out


def sampled_rows(
    batch: ScheduledBatch, logits: torch.Tensor
) -> Iterator[tuple[Sequence, int, torch.Tensor]]:
    """Each logits row a step may sample from, with its sequence and the output position it
    predicts (call before the engine sees the step): a sampling entry's last row, and every
    row of a decode with drafts (row j predicts position ``num_output_tokens + j``). A
    rejected draft's row is predicted again in a later step: keyed by position, the last
    row recorded is the one the token was sampled from."""
    end = 0
    for i, (seq, rows, sample) in enumerate(
        zip(batch.seqs, batch.logit_rows, batch.samples, strict=True)
    ):
        end += rows
        drafts = len(batch.drafts[i])
        for j in range(drafts + 1) if sample else ():
            yield seq, seq.num_output_tokens + j, logits[end - drafts - 1 + j]
    assert end == logits.shape[0]


class RowsByPosition:
    """Per request, a value kept of the row behind each output position (``sampled_rows``)."""

    def __init__(self) -> None:
        self.by_position: dict[str, dict[int, Any]] = {}

    def keep(self, batch: ScheduledBatch, logits: torch.Tensor, value: Any) -> None:
        for seq, position, row in sampled_rows(batch, logits):
            self.by_position.setdefault(seq.request_id, {})[position] = value(row)

    def __getitem__(self, request_id: str) -> list[Any]:
        """The request's values in output order."""
        held = self.by_position[request_id]
        return [held[p] for p in sorted(held)]

    def upto(self, request_id: str, num_outputs: int) -> list[Any]:
        """The values of its first ``num_outputs`` positions (a step that verified drafts
        past where the request finished computed rows nothing was sampled from)."""
        held = self.by_position[request_id]
        return [held[p] for p in sorted(held) if p < num_outputs]

    def clear(self) -> None:
        self.by_position.clear()


def transformers_greedy(
    model: Any, prompts: list[list[int]], new_tokens: int
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """A transformers model's greedy tokens and the logits behind each (float32), prompt by
    prompt, with its own KV cache: the reference the exactness tests hold us to."""
    from transformers import DynamicCache

    results = []
    with torch.inference_mode():
        for ids in prompts:
            cache = DynamicCache(config=model.config)
            out = model(torch.tensor([ids]), cache=cache, use_cache=True)
            tokens, logits = [], [out.logits[0, -1].float()]
            for _ in range(new_tokens):
                tokens.append(int(logits[-1].argmax()))
                out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
                logits.append(out.logits[0, -1].float())
            results.append((tokens, logits[:new_tokens]))
    return results
