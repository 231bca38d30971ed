"""``EngineConfig`` in the words of vLLM's ``AsyncEngineArgs``, without importing vLLM: one
mapping, for our replicas (``engine.engine_args`` adds the KV-event publisher) and for the
Ray Serve LLM peer the benchmarks give the same engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replica.config import VLLM_KWARGS_OURS, EngineConfig
from replica.model.cpu import resolve_dtype


def vllm_kwargs(config: EngineConfig) -> dict[str, Any]:
    """Every key of ``VLLM_KWARGS_OURS`` but the events, then ``vllm.engine_kwargs`` (which
    ``EngineConfig`` keeps off those keys)."""
    kwargs: dict[str, Any] = {
        "model": str(Path(str(config.model)).expanduser()),
        "served_model_name": [config.model_id],
        "block_size": config.block_size,
        "num_gpu_blocks_override": config.num_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "max_model_len": config.context_len,
        "enable_prefix_caching": config.enable_prefix_cache,
        "dtype": str(resolve_dtype(config.dtype)).removeprefix("torch."),
        "seed": config.seed,
        "enforce_eager": config.vllm.enforce_eager,
    }
    assert set(kwargs) == VLLM_KWARGS_OURS - {"kv_events_config"}, "the keys EngineConfig refuses"
    return kwargs | config.vllm.engine_kwargs
