"""Our router as a drop-in for Ray Serve LLM, end to end: Ray Serve LLM's own OpenAI app
(``bench/peers/ray_serve_llm.py``, in vLLM's virtualenv, its own private Ray) with 2 vLLM CPU
engines of SmolLM2 and ``request_router_class: cluster.ray_llm:RayLLMPrefixRouter``, driven
by the ``openai`` SDK, with a real redis-server for the index.

Ray's app says nothing of which replica served a request, so the checks read the two
things it does expose: the index the router's feeds wrote (our chain of every prompt, held
by one replica) and vLLM's own prefix-cache counters (through Ray's metrics agent). Each of
six prompts is sent twice: every block of every repeat is served from vLLM's cache only if
each repeat went to the replica holding its prompt; a router that chose blind would miss
about half of them.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import openai
import pytest
from conftest import vllm_paths

from bench.peers.ray_llm_stack import ray_llm
from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.reader import IndexReader
from replica.checkpoints import SMOLLM2

CHAIN_ROOT = "ray-serve-llm"  # cluster.ray_llm.MODEL_ID (that module imports ray.llm)
BLOCK = 32
BLOCKS = 6  # full blocks a prompt
VOCAB = range(1000, 20000)  # ordinary tokens of SmolLM2's vocabulary
ENGINE = {  # small and eager: starts in about a minute
    "block_size": BLOCK,
    "num_gpu_blocks_override": 256,
    "max_num_batched_tokens": 256,
    "max_model_len": 1024,
    "enforce_eager": True,
    "dtype": "float32",
}


def _held(index: IndexReader, chain: list[bytes], timeout_s: float = 30.0) -> dict[str, int]:
    """The replicas holding leading blocks of ``chain``, once one holds all of it."""
    deadline = time.monotonic() + timeout_s
    holders: dict[str, int] = {}
    while time.monotonic() < deadline:
        holders = {r: n for r, n in (index.cached(chain) or {}).items() if n}
        if len(chain) in holders.values():
            return holders
        time.sleep(0.2)
    return holders


def test_ray_serve_llm_with_our_router_sends_every_repeat_to_its_holder(tmp_path: Path) -> None:
    python, folder = vllm_paths()
    rng = random.Random(3)
    prompts = [[rng.choice(VOCAB) for _ in range(BLOCKS * BLOCK + 5)] for _ in range(6)]
    with ray_llm(python, folder, tmp_path, False, router="ours", engine_kwargs=ENGINE) as stack:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)

        def serve_all() -> None:
            for prompt in prompts:
                client.completions.create(model=SMOLLM2, prompt=prompt, max_tokens=2, temperature=0)

        serve_all()
        config = IndexConfig(url=stack.notes["index_url"], cluster="ray-llm")
        index = IndexReader(config, CHAIN_ROOT)
        try:
            hasher = BlockHasher(BLOCK, CHAIN_ROOT)
            held = [_held(index, hasher.chain(p)) for p in prompts]
            live = index.live_replicas()
        finally:
            index.close()
        assert len(live) == 2  # both replicas' feeds registered them
        # each prompt is in the index under our chain, every block of it on one replica
        assert all(sorted(h.values()) == [BLOCKS] for h in held), held
        before = stack.cache_counters()
        serve_all()
        after = stack.cache_counters()
    queried, hits = (a - b for a, b in zip(after, before, strict=True))
    assert queried == len(prompts) * (BLOCKS * BLOCK + 5)  # vLLM counts prompt tokens
    assert hits == len(prompts) * BLOCKS * BLOCK  # every repeat found all of its blocks
    if len({next(iter(h)) for h in held}) < 2:  # new prompts should spread over both
        # Known defect (README, "Our router in Ray Serve LLM's own app"): on Ray's
        # direct-streaming path every new prefix goes to one replica (in the benchmark, a
        # TTFT p50 of 10 s against Ray's routers' 1.2-1.5 s). What this test checks above
        # holds; this last check waits for the fix.
        pytest.xfail("the drop-in sends every new prefix to one replica")
