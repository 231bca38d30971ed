"""This project's engine from whichever tree comes first on ``PYTHONPATH`` (an older revision,
to measure against today's), answering timing jobs one JSON line at a time.

Imports nothing of ``bench``: it runs as a script, so the tree it measures is the one on the
path. The spec names the model, dtype, threads and sizes; each ``generate`` job empties the
prefix cache, then times one ``Engine.generate`` (greedy, EOS ignored).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _engine_api() -> tuple[Any, Any, Any]:
    """(build an engine with its model, EngineConfig, SamplingParams) of the revision on
    ``sys.path``: since 2026-12-05 the engine is handed its runner (``build_engine``);
    before, ``replica.engine`` exported all three and ``Engine(config)`` built the model."""
    try:
        from replica.config import EngineConfig
        from replica.model.runner import build_engine
        from replica.sampling.params import SamplingParams
    except ImportError:
        from replica.engine import Engine as build_engine  # type: ignore[no-redef]
        from replica.engine import EngineConfig, SamplingParams  # type: ignore[no-redef]
    return build_engine, EngineConfig, SamplingParams


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    import torch

    build, EngineConfig, SamplingParams = _engine_api()
    torch.set_num_threads(spec["threads"])
    started = time.perf_counter()
    config = EngineConfig(
        model=spec["model"],
        dtype=spec["dtype"],
        num_threads=spec["threads"],
        num_blocks=spec.get("num_blocks", 2048),
        max_num_seqs=spec.get("max_num_seqs", 32),
        **spec.get("engine", {}),
    )
    engine = build(config)
    sys.stdout.write(json.dumps({"startup_s": time.perf_counter() - started}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        job = json.loads(line)
        engine.reset_prefix_cache()
        params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
        start = time.perf_counter()
        engine.generate(job["prompts"], params)
        sys.stdout.write(json.dumps({"seconds": [time.perf_counter() - start]}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
