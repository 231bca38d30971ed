"""What runs an engine step's forward pass (the model, or the simulator's cost model)."""

from __future__ import annotations

from typing import Protocol

import torch

from replica.engine.scheduler import ScheduledBatch


class Runner(Protocol):
    """Runs a scheduled batch: the logits ([rows, vocab], float32) of the last
    ``batch.logit_rows[i]`` tokens of each sequence i, in batch order (its sampled token's
    row last)."""

    def execute(self, batch: ScheduledBatch) -> torch.Tensor: ...
