"""The engine room: one replica's paged engine without the model, scheduling and memory.

``engine.py`` (``Engine``: requests in, outputs out, one step at a time) drives the rest:
``scheduler.py`` picks each step's work within a token budget, ``block_manager.py`` gives
sequences their KV blocks through ``block_allocator.py`` (ref counts) and ``prefix_cache.py``
(verified hits by block hash), ``sequence.py`` is one request's state, ``choices.py`` forks
``n`` choices from one prefill, ``limits.py`` says what a request may ask, ``outputs.py`` is
what a step returns, ``audit.py`` recounts the blocks from scratch and ``stats.py`` the
counters. The model itself is in ``replica.model``; sampling in ``replica.sampling``.

``from replica.engine import Engine, EngineConfig, SamplingParams`` is the public API (the
names are loaded on first use, so the submodules import each other without a cycle).
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "CacheEvents": "replica.engine.prefix_cache",
    "Engine": "replica.engine.engine",
    "EngineConfig": "replica.config",
    "InvalidRequestError": "replica.messages",
    "ModelShape": "replica.model.shape",
    "RequestOutput": "replica.messages",
    "SamplingParams": "replica.sampling.params",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'replica.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
