"""The simulator's model of an engine step's time, fitted to the real engine.

``CostModel`` gives seconds per step from what the step computes; ``calibrate`` fits it by
timing the real model on a mixed workload (``--calibrate``; stored in ``calibration.json``);
``CostRunner`` stands in for the model in a simulated engine, advancing its ``Clock``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from replica.config import EngineConfig, SpeculationOptions
from replica.engine.engine import Engine
from replica.engine.step import ScheduledBatch
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step: ``base + prefill_token x P + decode_seq x D``, where P is
    the step's prefill (uncached) tokens and D its decoding sequences; and what a pull of B
    blocks from another replica takes: ``pull_call + pull_block x B`` seconds before the
    request is admitted, ``pull_block x B / 2`` of it on each engine's thread (the holder
    copies the blocks out and checksums them, the puller verifies and copies them in)."""

    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    measured: str = ""
    pull_call_s: float = 0.0
    pull_block_s: float = 0.0
    pull_measured: str = ""
    # a block restored from a node store: find, copy out of shared memory, verify, publish
    # (SmolLM2 bfloat16, 368,640-byte blocks; docs/results.md, "Second cache tier")
    store_block_s: float = 1.4e-4

    def pull_time(self, blocks: int) -> float:
        return self.pull_call_s + self.pull_block_s * blocks

    def step_time(self, batch: ScheduledBatch) -> float:
        return (
            self.base_s
            + self.prefill_token_s * batch.num_prefill_tokens
            + self.decode_seq_s * batch.num_decodes
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls(**json.loads(Path(path).read_text()))


DEFAULT_CALIBRATION = Path(__file__).with_name("calibration.json")


def no_drafts(config: EngineConfig) -> EngineConfig:
    """``config`` with speculative decoding off (the cost model prices one token per
    decode; the simulator's stand-in logits, all zeros, would accept any draft of token 0)."""
    return config.model_copy(update={"speculation": SpeculationOptions(enabled=False)})


def calibrate(config: EngineConfig, seed: int = 0) -> CostModel:
    """Fit the cost model to step times of the real engine on a mixed workload."""

    class Timed:
        def __init__(self) -> None:
            self.real = ModelRunner(config)
            self.samples: list[tuple[int, int, float]] = []

        def execute(self, batch: ScheduledBatch) -> torch.Tensor:
            t0 = time.perf_counter()
            logits = self.real.execute(batch)
            elapsed = time.perf_counter() - t0
            self.samples.append((batch.num_prefill_tokens, batch.num_decodes, elapsed))
            return logits

    runner = Timed()
    # one token per decode: the model's fit has no term for drafts (speculation is off in
    # the simulator too: its zero logits would make every draft of token 0 "accepted")
    plain = no_drafts(config).model_copy(update={"enable_prefix_cache": False})
    engine = Engine(plain, runner=runner)
    rng = np.random.default_rng(seed)
    for round_ in range(6):  # waves of varied prompt lengths and batch sizes
        n = int(rng.integers(1, 24))
        prompts = [rng.integers(0, 256, int(rng.integers(8, 700))).tolist() for _ in range(n)]
        engine.generate(
            prompts, SamplingParams(max_tokens=int(rng.integers(8, 40)), ignore_eos=True)
        )
        if round_ == 0:
            runner.samples.clear()  # the first wave warms torch up
    x = np.array([[1.0, p, d] for p, d, _ in runner.samples])
    y = np.array([t for _, _, t in runner.samples])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    base, per_token, per_seq = (max(float(c), 0.0) for c in coef)
    stamp = f"{len(y)} steps, torch {torch.__version__}, {torch.get_num_threads()} threads"
    return CostModel(base, per_token, per_seq, f"{stamp}, {time.strftime('%F')}")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class BlockTags:
    """A KV cache of one byte per block: what ``replica.kv.transfer`` copies between
    simulated engines (the real export and import, verification included)."""

    def __init__(self, num_blocks: int) -> None:
        self.data = torch.zeros(num_blocks, 1, dtype=torch.uint8)
        self.generations = np.zeros(num_blocks, np.int64)
        self.locator = None  # copies travel as bytes (no shared pool)


class CostRunner:
    """Stands in for the model: advances the replica's clock by the step's modelled cost,
    plus engine-thread time owed since the last step (``owed_s``: a pull's copies)."""

    def __init__(self, cost: CostModel, clock: Clock, vocab: int, num_blocks: int = 1) -> None:
        self.cost, self.clock, self.vocab = cost, clock, vocab
        self.kv_cache = BlockTags(num_blocks)
        self.owed_s = 0.0

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.clock.now += self.cost.step_time(batch) + self.owed_s
        self.owed_s = 0.0
        return torch.zeros(sum(batch.logit_rows), self.vocab)
