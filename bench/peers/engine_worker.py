"""This project's engine from whichever tree comes first on ``PYTHONPATH`` (an older revision,
to measure against today's), answering timing jobs one JSON line at a time.

Imports nothing of ``bench``: it runs as a script, so the tree it measures is the one on the
path. The spec names the model, dtype, threads and sizes; each ``generate`` job empties the
prefix cache, then times one batch through ``add_request``/``step`` (``timed_generate``:
greedy, EOS ignored), an API every revision since the first engine has.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any

_ids = itertools.count()


def timed_generate(engine: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """Run ``prompts`` together to completion and time two moments of that one run:
    ``first_s``, when every prompt had its first token (its prefill done), and ``total_s``,
    when all had finished. ``tokens_at_first`` counts the output tokens that existed at the
    first moment, so the rest were decoded after it: decode's rate is measured inside one
    run, never as a difference of two runs' times (which noise can make negative).

    ``engine`` is any revision's engine: ``add_request(id, prompt, params)`` and ``step()``
    returning outputs with ``request_id``, ``new_token_ids`` and ``finished``."""
    ids = [f"timed-{next(_ids)}" for _ in prompts]
    counts = dict.fromkeys(ids, 0)
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    unfinished = set(ids)
    first_s, tokens_at_first = 0.0, 0
    while unfinished:
        for out in engine.step():
            counts[out.request_id] += len(out.new_token_ids)
            if out.finished:
                unfinished.discard(out.request_id)
        if not tokens_at_first and all(counts.values()):
            first_s, tokens_at_first = time.perf_counter() - start, sum(counts.values())
    total_s = time.perf_counter() - start
    return {"seconds": [total_s], "first_s": first_s, "tokens_at_first": tokens_at_first}


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
        sys.stdout.write(json.dumps(timed_generate(engine, job["prompts"], params)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
