"""What a replica's process is given and uses: the engine's settings as Ray's resources for
this replica shape them, and its resident memory (for the overload and soak reports)."""

from __future__ import annotations

import math
import os
from typing import Any

import ray

from replica.args import ReplicaArgs
from replica.config import EngineConfig


def rss_mb() -> float | None:
    """Resident memory of this process (Linux), for the overload and soak reports."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def engine_config(args: ReplicaArgs) -> EngineConfig:
    """``num_threads`` unset: as many torch threads as CPUs Ray gave this replica (rounded
    up), so replicas sharing a machine do not oversubscribe it. The pool is shared memory
    when same-node pulls read it."""
    update: dict[str, Any] = {}
    if args.engine.num_threads is None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        update["num_threads"] = max(1, math.ceil(cpus))
    if args.pull.enabled and args.pull.shared_memory:
        update["shared_kv_pool"] = True
    return args.engine.model_copy(update=update)
