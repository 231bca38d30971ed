"""The engine end to end (no Ray): sharing on arrival, equivalence, preemption, errors."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
from conftest import RowsByPosition, tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import kvindex.hashing
from replica.checkpoints.hf import hf_config
from replica.engine.step import Runner, ScheduledBatch
from replica.errors import InvalidRequestError
from replica.model.cpu import DTYPES
from replica.model.llama import LlamaForCausalLM
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def shared_prefix_prompts(n: int, seed: int = 0, block_size: int = 16) -> list[list[int]]:
    """Prompts in three groups sharing 1-4 full blocks, with unique tails of 1-20 tokens."""
    rng = random.Random(seed)
    systems = [[256] + [rng.randrange(256) for _ in range(k * block_size - 1)] for k in (1, 3, 4)]
    return [
        systems[i % 3] + [rng.randrange(256) for _ in range(rng.randrange(1, 21))] for i in range(n)
    ]


def test_requests_arriving_together_compute_a_shared_prompt_once() -> None:
    engine = build_engine(tiny(block_size=16))
    system = [256] + list(range(63))  # 4 full blocks
    tails = [[100 + i] * (i + 1) for i in range(8)]
    outs = engine.generate([system + t for t in tails], SamplingParams(max_tokens=1))
    assert [o.num_cached_tokens for o in outs] == [0] + [64] * 7
    stats = engine.stats()
    assert stats.steps == 1  # all eight were prefilled in the same step
    assert stats.computed_tokens == 64 + sum(len(t) for t in tails)
    assert stats.cached_prompt_tokens == 7 * 64
    assert stats.hit_rate == pytest.approx(7 * 64 / (8 * 64 + sum(len(t) for t in tails)))


@pytest.mark.parametrize("max_num_seqs", [4, 32])
def test_greedy_output_is_identical_with_the_cache_on_and_off(max_num_seqs: int) -> None:
    prompts = shared_prefix_prompts(18)
    on = build_engine(tiny(max_num_seqs=max_num_seqs))
    off = build_engine(tiny(max_num_seqs=max_num_seqs, enable_prefix_cache=False))
    outs_on, outs_off = on.generate(prompts, GREEDY), off.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    assert on.stats().cached_prompt_tokens > 0
    assert off.stats().cached_prompt_tokens == 0
    # the model's output depends on the context, so a wrong hit would show
    assert len({tuple(o.token_ids) for o in outs_off}) == len(prompts)


def test_equivalence_holds_under_memory_pressure_with_preemption() -> None:
    prompts = shared_prefix_prompts(12, seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    tight = build_engine(tiny(num_blocks=24, max_num_seqs=12))
    reference = build_engine(tiny(enable_prefix_cache=False))
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference.generate(prompts, params)]
    stats = tight.stats()
    assert stats.preemptions > 0
    assert stats.evictions > 0
    assert stats.blocks_in_use == 0
    assert stats.blocks_free + stats.blocks_cached == stats.blocks_total


@pytest.mark.parametrize("budget", [16, 37])
def test_chunked_prefill_changes_no_output(budget: int) -> None:
    prompts = [*shared_prefix_prompts(10, seed=8), [256, *range(200)]]
    whole = build_engine(tiny(enable_chunked_prefill=False)).generate(prompts, GREEDY)
    engine = build_engine(tiny(max_num_batched_tokens=budget, max_num_seqs=8))
    chunked = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    # the 201-token prompt alone needs ceil(201 / budget) chunk steps, then 23 decodes
    assert engine.stats().steps >= -(-201 // budget) + GREEDY.max_tokens - 1
    assert engine.stats().cached_prompt_tokens > 0


def test_a_fully_cached_prompt_still_runs_and_gives_the_same_output() -> None:
    engine = build_engine(tiny(block_size=16))
    prompt = [256] + list(range(47))  # exactly 3 blocks
    first = engine.generate([prompt], GREEDY)[0]
    computed = engine.stats().computed_tokens
    second = engine.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 32  # capped at (48 - 1) // 16 blocks
    assert engine.stats().computed_tokens - computed == 16 + GREEDY.max_tokens - 1
    assert second.token_ids == first.token_ids


def test_a_forced_hash_collision_does_not_change_any_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = shared_prefix_prompts(9, seed=5)
    expected = build_engine(tiny(enable_prefix_cache=False)).generate(prompts, GREEDY)
    monkeypatch.setattr(kvindex.hashing, "_digest", lambda data, key: b"\x01" * 16)
    engine = build_engine(tiny())
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert engine.stats().hash_mismatches > 0
    assert engine.stats().cached_prompt_tokens > 0  # true prefixes are still shared


def test_a_trace_without_shared_text_gets_no_hits() -> None:
    rng = random.Random(11)
    prompts = [[256] + [rng.randrange(256) for _ in range(80)] for _ in range(10)]
    engine = build_engine(tiny())
    engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.stats().cached_prompt_tokens == 0
    assert engine.stats().hit_rate == 0.0


def test_stop_conditions() -> None:
    engine = build_engine(tiny())
    prompt = [256, *b"stop here"]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12
    stop_at = free_run.token_ids[5]
    cut = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free_run.token_ids[: free_run.token_ids.index(stop_at) + 1]

    eos_engine = build_engine(tiny(model={"eos_token_ids": [stop_at]}))
    at_eos = eos_engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert at_eos.finish_reason == "stop" and at_eos.token_ids[-1] == stop_at
    ignored = eos_engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == free_run.token_ids


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    prompt = [256, *b"sample me"]
    alone = build_engine(tiny()).generate([prompt], params)[0]
    crowd = shared_prefix_prompts(5) + [prompt]
    together = build_engine(tiny()).generate(crowd, [GREEDY] * 5 + [params])[-1]
    assert alone.token_ids == together.token_ids
    greedy = build_engine(tiny()).generate([prompt], SamplingParams(max_tokens=16))[0]
    assert alone.token_ids != greedy.token_ids


def test_streaming_step_outputs_and_abort_free_blocks() -> None:
    engine = build_engine(tiny(num_blocks=64))
    engine.add_request("keep", [256, *b"hello"], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("drop", [256] + [7] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    streamed: list[int] = []
    first = engine.step()
    assert {o.request_id for o in first} == {"keep", "drop"}
    assert engine.abort_request("drop")
    assert not engine.abort_request("drop")
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"
            streamed += out.new_token_ids
    assert len(streamed) == 4
    stats = engine.stats()
    assert stats.num_aborted == 1 and stats.num_finished == 1
    assert stats.blocks_in_use == 0
    engine.check_invariants()


def test_invalid_requests_get_clear_errors_and_change_nothing() -> None:
    engine = build_engine(tiny(num_blocks=8, block_size=16, max_model_len=512))
    cases = [
        ([], SamplingParams(), "empty"),
        ([1, 2, 999], SamplingParams(), r"\[0, 258\)"),
        ([1] * 500, SamplingParams(max_tokens=20), "context of 512"),
        ([1] * 100, SamplingParams(max_tokens=100), "more KV blocks"),
    ]
    for tokens, params, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("bad", tokens, params)
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("ok", [1, 2, 3])
    assert not engine.has_unfinished_requests() or engine.stats().num_waiting == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_finished == 1
    engine.check_invariants()


def test_events_let_an_observer_track_the_cached_set_exactly() -> None:
    engine = build_engine(tiny(num_blocks=40))
    view: set[bytes] = set()

    def apply(events):  # what the index does with them
        if events.cleared:
            view.clear()
        view.difference_update(events.removed)
        view.update(events.stored)

    engine.subscribe(apply)
    for seed in range(4):
        engine.generate(shared_prefix_prompts(6, seed=seed), GREEDY)
        assert view == engine.cached_block_hashes()
    assert engine.stats().evictions > 0
    assert engine.reset_prefix_cache()
    assert view == set() == engine.cached_block_hashes()


def test_the_default_model_has_the_documented_size_and_seeded_weights() -> None:
    """README: 5,772,544 parameters with seeded random weights: the same seed gives the same
    weights (and outputs) in any engine, another seed other weights."""
    a, b, c = (build_engine(tiny(seed=seed)) for seed in (0, 0, 1))
    assert a.runner.num_parameters == 5_772_544
    weights = [r.runner.model.model.embed_tokens.weight for r in (a, b, c)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_weights_load_from_a_hugging_face_folder(tmp_path) -> None:
    source = build_engine(tiny(seed=42))
    model = LlamaForCausalLM(source.config.shape)  # the engine's own are packed for oneDNN
    model.init_random(42)
    weights = model.hf_state_dict()
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model.config)))
    loaded = build_engine(tiny(seed=0, model=str(tmp_path)))
    assert loaded.config.model_id == tmp_path.name
    prompts = shared_prefix_prompts(3)
    assert [o.token_ids for o in loaded.generate(prompts, GREEDY)] == [
        o.token_ids for o in source.generate(prompts, GREEDY)
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "abort"]),
            st.integers(0, 3),  # which shared prefix
            st.integers(1, 30),  # tail length
            st.integers(1, 20),  # max tokens
        ),
        min_size=5,
        max_size=40,
    )
)
def test_block_accounting_adds_up_after_every_step(ops) -> None:
    engine = build_engine(
        tiny(
            model={"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1},
            block_size=4,
            num_blocks=14,
            max_num_seqs=4,
            max_num_batched_tokens=8,  # most prompts run in several chunks
        )
    )
    prefixes = [[256] + [p] * (4 * p + 3) for p in range(4)]
    live: list[str] = []
    for i, (op, prefix, tail, max_tokens) in enumerate(ops):
        if op == "add":
            prompt = prefixes[prefix] + [i % 256] * tail
            try:
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens))
                live.append(f"r{i}")
            except InvalidRequestError:  # more blocks than the pool has: refused, no change
                assert len(prompt) + max_tokens - 1 > 14 * 4
        elif op == "abort" and live:
            engine.abort_request(live.pop(prefix % len(live)))
        else:
            engine.step()
        engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    stats = engine.stats()
    assert stats.blocks_in_use == 0
    assert stats.blocks_free + stats.blocks_cached == stats.blocks_total


def test_extreme_sampling_parameters_never_break_a_step() -> None:
    engine = build_engine(tiny())
    prompt = [256, *b"edge"]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    cold = SamplingParams(max_tokens=6, temperature=1e-30, seed=-(2**70))
    assert engine.generate([prompt], cold)[0].token_ids == greedy
    wild = SamplingParams(max_tokens=6, temperature=2.0, top_p=1e-300, seed=2**90)
    assert engine.generate([prompt], wild)[0].token_ids == greedy  # top_p keeps the top token
    engine.check_invariants()


class LogitsRecorder:
    """Stands between an engine and its model: keeps, per request, the logits row each of its
    tokens was sampled from (as float64), and passes everything through unchanged."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.rows = RowsByPosition()

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        logits = self.runner.execute(batch)
        self.rows.keep(batch, logits, torch.Tensor.double)
        return logits


DTYPE_PROMPTS = shared_prefix_prompts(6, seed=7)
DTYPE_PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
Run = tuple[list[list[int]], list[list[torch.Tensor]]]  # tokens, and logits rows, per prompt


@functools.cache
def dtype_run(dtype: str, cache: bool) -> Run:
    """Greedy tokens and the logits behind them, for ``DTYPE_PROMPTS`` in one dtype."""
    deterministic = dtype != "float64"  # float64's matrix products are not row-invariant
    engine = build_engine(tiny(dtype=dtype, enable_prefix_cache=cache, deterministic=deterministic))
    # the dtype is really used: weights and the paged KV cache are held in it
    assert {p.dtype for p in engine.runner.model.parameters()} == {DTYPES[dtype]}
    assert engine.runner.kv_cache.dtype == DTYPES[dtype]
    recorder = LogitsRecorder(engine.runner)
    engine.runner = recorder
    outs = engine.generate(DTYPE_PROMPTS, DTYPE_PARAMS)
    assert (engine.stats().cached_prompt_tokens > 0) is cache  # the prompts share blocks
    return [o.token_ids for o in outs], [recorder.rows[o.request_id] for o in outs]


def comparable_rows(a: Run, b: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of logits rows of the same prompt and step, while both runs had generated the
    same tokens before it (after a greedy choice differs, the contexts differ too)."""
    pairs = []
    for tokens_a, rows_a, tokens_b, rows_b in zip(*a, *b, strict=True):
        for step, (row_a, row_b) in enumerate(zip(rows_a, rows_b, strict=True)):
            if tokens_a[:step] != tokens_b[:step]:
                break
            pairs.append((row_a, row_b))
    return pairs


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_float64_gives_float32s_greedy_tokens_with_the_cache_on_and_off() -> None:
    """``dtype: float64`` runs the model in float64 (its logits differ from float32's in the
    last bits, so it is not float32 under another name) and gives float32's greedy tokens,
    with the prefix cache on and off alike."""
    reference = dtype_run("float32", False)
    for cache in (False, True):
        assert dtype_run("float32", cache)[0] == reference[0]
        run = dtype_run("float64", cache)
        assert run[0] == reference[0]
        pairs = comparable_rows(run, reference)
        assert len(pairs) == len(DTYPE_PROMPTS) * DTYPE_PARAMS.max_tokens
        worst = max(float((a - b).abs().max()) for a, b in pairs)
        assert 0 < worst < 1e-3


BFLOAT16_TOLERANCE = 0.2  # relative L2 error of a logits row; measured up to 0.096


def test_bfloat16_logits_stay_near_float32s_and_the_cache_changes_no_bit() -> None:
    """``dtype: bfloat16`` holds 8 significant bits, so its rounding flips near-ties between
    top tokens: its greedy tokens need not be float32's. Its logits stay within
    ``BFLOAT16_TOLERANCE`` (relative L2) of float32's at the same context; a wrong hit would
    not (the logits of two different prompts are ~1.2 apart on this scale). And with the
    engine's invariance (``deterministic``), the cache on and off give the same tokens and
    bitwise the same logits, though the cached keys and values were computed in another
    batch."""
    reference = dtype_run("float32", False)
    first_rows = [rows[0] for rows in reference[1]]
    assert (
        min(relative_error(a, b) for a in first_rows for b in first_rows if a is not b)
        > 5 * BFLOAT16_TOLERANCE
    )
    on, off = dtype_run("bfloat16", True), dtype_run("bfloat16", False)
    for a in on, off:
        pairs = comparable_rows(a, reference)
        assert len(pairs) >= len(DTYPE_PROMPTS)  # every prompt's first token at least
        assert max(relative_error(x, y) for x, y in pairs) < BFLOAT16_TOLERANCE
    assert on[0] == off[0]
    assert all(torch.equal(x, y) for x, y in comparable_rows(on, off))
    assert len(comparable_rows(on, off)) == len(DTYPE_PROMPTS) * DTYPE_PARAMS.max_tokens


@pytest.mark.parametrize("expect", [True, False])
def test_a_queued_request_still_hits_the_prefix_it_was_sent_for(
    expect: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request queued behind a prefill that needs the pool's cached blocks keeps its
    prefix: ``add_request`` makes the blocks it will hit the most recent
    (``BlockManager.expect``), so the prefill ahead evicts the others. Without that, the
    one-off prompt cached after it would outlive it (the check that this test can fail)."""
    if not expect:
        monkeypatch.setattr("replica.engine.blocks.manager.BlockManager.expect", lambda *a: 0)
    engine = build_engine(tiny(num_blocks=8, block_size=16, max_num_seqs=4))
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    tenant = [256] + list(range(31))  # two full blocks
    engine.generate([[*tenant, 7]], one)  # cached: the tenant's two blocks
    engine.generate([list(range(100, 133))], one)  # then a one-off prompt's two
    ahead = list(range(140, 221))  # 81 tokens: 6 blocks, 2 of them evicted
    outs = engine.generate([ahead, [*tenant, 9]], one)
    assert outs[1].num_cached_tokens == (32 if expect else 0)
    assert engine.block_manager.allocator.num_in_use == 0
