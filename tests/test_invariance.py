"""The same request gives the same tokens, whatever else runs: SmolLM2 in the dtype served.

The real model with ``dtype: auto`` (bfloat16 where this CPU has native bfloat16, float32
elsewhere; every test id names the dtype that ran) and ``deterministic: true``, the defaults
of ``deploy/config.yaml``. Eight chat prompts (29 to 1,100+ tokens), 128 greedy tokens each,
are first run one at a time with nothing cached. Every other way of running them must give
the same tokens, and bitwise the same logits row behind every token: batched with prefills
and decodes in one step, after another request cached their system prompt, chunked over many
steps, resumed from an output position as a continuation, and preempted. Seeded sampling
and replies held to a JSON schema hold the same way. The references decode one token per
step; every other run has the engine's prompt-lookup drafts on (its default), so each of
these ways is also checked with drafts verified in the step (``test_speculation.py`` varies
the draft length and mixes in requests that opt out). The kernel-level checks (a linear
layer's row, an attention query) are in ``test_kernels.py``.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from chat_prompts import SHARING_THE_SYSTEM_PROMPT, chat_prompts, encode
from conftest import RowsByPosition

from bench.assistant_prompts import SUPPORT_SYSTEM_PROMPT
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.config import EngineConfig, SpeculationOptions
from replica.engine.engine import Engine
from replica.engine.step import ScheduledBatch
from replica.messages import Owner
from replica.model.cpu import resolve_dtype
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams, StructuredOutput
from replica.store.layout import StoreGeometry, fingerprint
from replica.store.node_store import NodeStore
from replica.store.tier import StoreTier

NEW_TOKENS = 128
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
PLAIN = SpeculationOptions(enabled=False)  # the references: one token per step, no drafts
SERVED = str(resolve_dtype("auto")).removeprefix("torch.")
Run = dict[str, tuple[list[int], list[bytes]]]  # request id -> tokens, digests of their rows


class Digests:
    """The real runner, keeping a digest of the logits row each sampled token came from."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows = RowsByPosition()
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        logits = self.runner.execute(batch)
        self.batches.append(batch)
        self.rows.keep(batch, logits, digest)
        return logits


def digest(row: torch.Tensor) -> bytes:
    return hashlib.blake2b(row.numpy().tobytes(), digest_size=16).digest()


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(EngineConfig(model=SMOLLM2, dtype="auto", num_blocks=768))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return chat_prompts(checkpoint_for(SMOLLM2).tokenizer())


def engine_with(runner: ModelRunner, **config) -> tuple[Engine, Digests]:
    digests = Digests(runner)
    engine = Engine(EngineConfig(model=SMOLLM2, dtype="auto", **config), runner=digests)
    return engine, digests


def run(
    engine: Engine, digests: Digests, prompts, params=GREEDY
) -> list[tuple[list[int], list[bytes]]]:
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    return [(o.token_ids, digests.rows.upto(o.request_id, len(o.token_ids))) for o in outs]


@pytest.fixture(scope="module")
def alone(runner, prompts) -> list[tuple[list[int], list[bytes]]]:
    """Each prompt by itself, on an engine that caches nothing."""
    engine, digests = engine_with(
        runner, num_blocks=768, enable_prefix_cache=False, speculation=PLAIN
    )
    results = [run(engine, digests, [p])[0] for p in prompts]
    assert all(len(tokens) == NEW_TOKENS for tokens, _ in results)
    return results


def assert_same(results, reference) -> None:
    """Same tokens and bitwise the same logits behind each, prompt by prompt."""
    for i, ((tokens, rows), (want_tokens, want_rows)) in enumerate(
        zip(results, reference, strict=True)
    ):
        assert tokens == want_tokens, (
            f"prompt {i}: tokens from {first_difference(tokens, want_tokens)}"
        )
        assert rows == want_rows, f"prompt {i}: logits from {first_difference(rows, want_rows)}"


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@pytest.mark.parametrize("dtype", [SERVED])
def test_the_prompts_cover_what_invariance_needs(runner, prompts, alone, dtype) -> None:
    assert runner.kv_cache.dtype == resolve_dtype("auto")
    assert len(prompts) >= 8 and max(len(p) for p in prompts) > 1000
    assert len({tuple(t) for t, _ in alone}) == len(prompts)  # every prompt its own answer


@pytest.mark.parametrize("dtype", [SERVED])
def test_batched_with_prefills_and_decodes_in_one_step(runner, prompts, alone, dtype) -> None:
    engine, digests = engine_with(runner, num_blocks=768, enable_prefix_cache=False)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids[:4], prompts[:4], strict=True):
        engine.add_request(rid, p, GREEDY)
    finished = {}
    while len(finished) < len(ids):
        if len(digests.batches) == 2:  # the first four decode while the rest prefill
            for rid, p in zip(ids[4:], prompts[4:], strict=True):
                engine.add_request(rid, p, GREEDY)
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert any(b.num_decodes and b.num_prefill_tokens for b in digests.batches)
    assert_same([(finished[r].token_ids, digests.rows.upto(r, NEW_TOKENS)) for r in ids], alone)


@pytest.mark.parametrize("dtype", [SERVED])
def test_urgent_prompts_computed_first_change_nothing(runner, prompts, alone, dtype) -> None:
    """Prompts 4-7 arrive at priority 5 while 0-3 (priority 0) are being prefilled in
    chunks: theirs are computed first, the others' chunks wait (``replica.engine.scheduler``),
    and every token and logits row is still the one of the prompt alone."""
    engine, digests = engine_with(
        runner, num_blocks=768, max_num_batched_tokens=64, enable_prefix_cache=False
    )
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids[:4], prompts[:4], strict=True):
        engine.add_request(rid, p, GREEDY)
    finished = {}
    while len(finished) < len(ids):
        if len(digests.batches) == 2:
            for rid, p in zip(ids[4:], prompts[4:], strict=True):
                engine.add_request(rid, p, GREEDY, owner=Owner("urgent", priority=5))
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    urgent_only = [
        b
        for b in digests.batches[2:]
        if any(q.priority == 5 for q in b.seqs)
        and all(q.priority == 5 or n == 1 for q, n in zip(b.seqs, b.num_new_tokens, strict=True))
    ]
    assert len(urgent_only) > 4  # steps that computed urgent prompts and only decoded others
    assert_same([(finished[r].token_ids, digests.rows.upto(r, NEW_TOKENS)) for r in ids], alone)


@pytest.mark.parametrize("dtype", [SERVED])
def test_a_prefix_cached_by_another_request_changes_nothing(runner, prompts, alone, dtype) -> None:
    engine, digests = engine_with(runner, num_blocks=768)
    other = encode(checkpoint_for(SMOLLM2).tokenizer(), SUPPORT_SYSTEM_PROMPT, "Hello?")
    engine.generate([other], SamplingParams(max_tokens=3))
    outs = engine.generate(prompts, GREEDY)
    assert all(outs[i].num_cached_tokens >= 512 for i in SHARING_THE_SYSTEM_PROMPT)
    assert_same(
        [(o.token_ids, digests.rows.upto(o.request_id, len(o.token_ids))) for o in outs], alone
    )
    engine.check_invariants()


@pytest.mark.parametrize("dtype", [SERVED])
def test_prompts_chunked_over_many_steps_change_nothing(runner, prompts, alone, dtype) -> None:
    engine, digests = engine_with(
        runner, num_blocks=768, max_num_batched_tokens=48, enable_prefix_cache=False
    )
    results = run(engine, digests, prompts)
    assert max(b.num_tokens for b in digests.batches) <= 48
    assert sum(b.samples.count(False) for b in digests.batches) > 20  # chunks short of the end
    assert_same(results, alone)


@pytest.mark.parametrize("dtype", [SERVED])
def test_a_request_resumed_from_any_output_position_continues_exactly(
    runner, prompts, alone, dtype
) -> None:
    """Prompt plus its first k tokens, sent as a continuation (what failover does): the rest
    of the output, and the logits behind it, are the uninterrupted run's."""
    engine, digests = engine_with(runner, num_blocks=768)
    positions = [1, 17, 33, 64, 90, 101, 120, NEW_TOKENS - 1]
    for i, (prompt, k) in enumerate(zip(prompts, positions, strict=True)):
        engine.add_request(f"resume{i}", prompt, GREEDY, output_token_ids=alone[i][0][:k])
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    for i, k in enumerate(positions):
        out = finished[f"resume{i}"]
        tokens, rows = alone[i]
        assert out.token_ids == tokens, f"prompt {i} resumed at {k}"
        assert digests.rows[f"resume{i}"] == rows[k:], f"prompt {i} resumed at {k}"
    engine.check_invariants()


@pytest.mark.parametrize("dtype", [SERVED])
def test_preemption_on_a_small_pool_changes_nothing(runner, prompts, alone, dtype) -> None:
    engine, digests = engine_with(runner, num_blocks=96, max_num_seqs=8, decode_reserve=False)
    results = run(engine, digests, prompts)
    assert engine.stats().preemptions > 0
    assert_same(results, alone)


@pytest.mark.parametrize("dtype", [SERVED])
def test_seeded_sampling_is_invariant_too(runner, prompts, dtype) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    engine, digests = engine_with(
        runner, num_blocks=768, enable_prefix_cache=False, speculation=PLAIN
    )
    solo = [run(engine, digests, [p], params)[0] for p in prompts[:4]]
    engine, digests = engine_with(runner, num_blocks=768)
    engine.generate([prompts[1]], SamplingParams(max_tokens=2))  # the system prompt cached
    assert_same(run(engine, digests, prompts[:4], params), solo)


ANSWER = {  # a reply held to this schema: constrained decoding in the dtype served
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 60}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}


@pytest.mark.parametrize("dtype", [SERVED])
def test_constrained_requests_are_invariant_too(runner, prompts, dtype) -> None:
    """Held to a JSON schema, greedy and seeded: the same tokens and logits alone, batched
    with the other prompts (after their system prompt was cached) and resumed halfway."""
    structured = StructuredOutput(kind="json_schema", schema_text=json.dumps(ANSWER))
    greedy = SamplingParams(max_tokens=48, structured=structured)
    seeded = greedy.model_copy(update={"temperature": 0.8, "seed": 77})
    cases = [(p, params) for p in prompts[:3] for params in (greedy, seeded)]
    engine, digests = engine_with(
        runner, num_blocks=768, enable_prefix_cache=False, speculation=PLAIN
    )
    solo = [run(engine, digests, [p], params)[0] for p, params in cases]
    engine, digests = engine_with(runner, num_blocks=768)
    engine.generate([prompts[1]], SamplingParams(max_tokens=2))
    outs = engine.generate([p for p, _ in cases], [params for _, params in cases])
    assert_same(
        [(o.token_ids, digests.rows.upto(o.request_id, len(o.token_ids))) for o in outs], solo
    )
    for i, ((p, params), (tokens, _)) in enumerate(zip(cases, solo, strict=True)):
        engine.add_request(f"half{i}", p, params, output_token_ids=tokens[: len(tokens) // 2])
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert [finished[f"half{i}"] for i in range(len(cases))] == [t for t, _ in solo]
    engine.check_invariants()


@pytest.mark.parametrize("dtype", [SERVED])
def test_a_prefix_restored_from_the_node_store_changes_nothing(runner, prompts, alone, dtype):
    """Every prompt run once (its blocks spill into a node store when released), the pool
    then emptied, and every prompt run again: each restores its prefix from the store,
    with the same tokens and bitwise the same logits as with nothing cached."""
    digests = Digests(runner)
    digests.kv_cache = runner.kv_cache  # the pool the tier copies out of and into
    engine = Engine(EngineConfig(model=SMOLLM2, dtype="auto", num_blocks=768), runner=digests)
    data = runner.kv_cache.data
    layout = (str(data.dtype), tuple(data.shape[1:]))
    print_ = fingerprint(engine.hasher.model_id, engine.hasher.block_size, b"", layout)
    geometry = StoreGeometry(engine.hasher.block_size, data[0].nbytes, 64, 16)  # 1,024 slots
    engine.attach_store(StoreTier(NodeStore.anonymous(geometry, print_), background=False))
    engine.generate(prompts, SamplingParams(max_tokens=1))
    assert engine.reset_prefix_cache()
    digests.rows.clear()
    outs = engine.generate(prompts, GREEDY)
    assert engine.store is not None  # the longest prompt alone restores this many blocks:
    assert engine.store.counters.restored_blocks >= max((len(p) - 1) // 16 for p in prompts)
    restored = [o.num_cached_tokens for o in outs]
    assert restored == [(len(p) - 1) // 16 * 16 for p in prompts], restored
    assert_same(
        [(o.token_ids, digests.rows.upto(o.request_id, len(o.token_ids))) for o in outs], alone
    )
    engine.check_invariants()
