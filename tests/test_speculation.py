"""Prompt-lookup speculative decoding changes how many tokens a step yields, never which.

Three layers. The drafter alone: its incremental n-gram index proposes what a brute-force
scan of the text proposes. The block accounting on a tiny pool, with a runner that makes
greedy decoding follow a script (so which drafts are kept is known): rejected drafts' blocks
go back, only verified blocks are published, the accounting adds up after every step.
SmolLM2 in the dtype served: at draft lengths 1, 2, 4 and 8, greedy and seeded with
penalties, held to JSON, batched with requests that opt out, on a pool small enough to
preempt, the tokens, their logprobs and the logits rows behind them are bitwise those of
decoding one token per step. (``test_invariance.py`` runs its whole suite with drafts on
against references without them.)
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from chat_prompts import chat_prompts, encode
from conftest import RowsByPosition, tiny

from bench.assistant_prompts import LONG_DOCUMENT
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.config import EngineConfig, SpeculationOptions
from replica.engine.drafts import Drafter
from replica.engine.engine import Engine
from replica.engine.sequence import Sequence
from replica.engine.step import ScheduledBatch
from replica.engine.step_cost import StepCost
from replica.model.cpu import resolve_dtype
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams, StructuredOutput

SERVED = str(resolve_dtype("auto")).removeprefix("torch.")
NEW_TOKENS = 96


# -- the drafter -----------------------------------------------------------------------------


def brute_force(tokens: list[int], n_min: int, n_max: int, limit: int) -> list[int]:
    """What the drafter must propose: after the latest earlier occurrence of the longest
    suffix of ``n_min..n_max`` tokens that occurred before, the next ``limit`` tokens."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + limit]
    return []


def test_the_incremental_index_proposes_what_a_scan_finds() -> None:
    rng = random.Random(3)
    for trial in range(60):
        options = SpeculationOptions(max_draft_tokens=5, ngram_min=1 + trial % 2, ngram_max=3)
        drafter, tokens = Drafter(options), [rng.randrange(6) for _ in range(5)]
        state = drafter.new_state()
        for _ in range(40):  # grown a few tokens at a time, as decoding grows it
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]
            limit = rng.randint(1, 5)
            want = brute_force(tokens, options.ngram_min, options.ngram_max, limit)
            assert drafter.propose(state, tokens, limit) == want, (trial, tokens)


def test_drafts_copy_the_text_after_the_longest_match_and_adapt_their_length() -> None:
    drafter = Drafter(SpeculationOptions(max_draft_tokens=6, ngram_min=2, ngram_max=3))
    state = drafter.new_state()
    text = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" (n = 3) last occurred at the start: its continuation, not "2 3 -> 7 8"
    assert drafter.propose(state, text, 4) == [4, 5, 6, 9]
    assert drafter.propose(state, [*text, 11, 12], 4) == []  # "3 11 12" never seen
    assert state.length == 6
    drafter.record(state, drafted=4, accepted=2)
    assert state.length == 5  # one fewer after a rejection
    drafter.record(state, drafted=5, accepted=5)
    assert state.length == 6  # two more after all kept, capped
    assert drafter.propose(drafter.new_state(), text, 100) == [4, 5, 6, 9, 2, 3]
    fixed = Drafter(SpeculationOptions(max_draft_tokens=3, adaptive=False))
    still = fixed.new_state()
    fixed.record(still, drafted=3, accepted=0)
    assert still.length == 3


def test_the_step_cost_line_and_what_a_draft_must_be_kept_with_to_pay() -> None:
    """Steps of 13 ms plus 1.27 ms a token (this CPU's SmolLM2 decode, README): a draft in a
    batch-1 step pays from a 9% chance of being kept, in a batch-32 step from 76%."""
    cost = StepCost()
    assert cost.draft_threshold(1, 1) == 0.0  # nothing known: drafts limited by length only
    for tokens in (1, 5, 8, 32, 40, 64, 3, 17, 100, 2):
        cost.record(tokens, 0.013 + 0.00127 * tokens)
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(0.013) and per_token == pytest.approx(0.00127)
    assert cost.draft_threshold(1, 1) == pytest.approx(0.00127 / 0.01427)
    assert cost.draft_threshold(32, 32) == pytest.approx(32 * 0.00127 / (0.013 + 0.04064))
    steady = StepCost()
    for _ in range(50):
        steady.record(32, 0.05)
    assert steady.line() is None  # one size of step says nothing of a token's cost


def test_a_sequence_drafts_only_what_its_keep_rate_pays_for() -> None:
    drafter = Drafter(SpeculationOptions(max_draft_tokens=8))
    state = drafter.new_state()
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2]
    assert len(drafter.propose(state, text, 8, threshold=0.0)) == 8  # no cost known
    assert len(drafter.propose(state, text, 8, threshold=0.76)) == 0  # prior 0.75 < 0.76
    for _ in range(30):  # a sequence that copies: every draft kept
        drafter.record(state, drafted=4, accepted=4)
    assert state.keep_rate > 0.95
    assert len(drafter.propose(state, text, 8, threshold=0.76)) >= 5
    for _ in range(30):  # one that does not: its first draft rejected every step
        drafter.record(state, drafted=2, accepted=0)
    assert state.keep_rate < 0.2
    assert len(drafter.propose(state, text, 8, threshold=0.2)) == 0


# -- blocks on a tiny pool ---------------------------------------------------------------------


class Scripted:
    """The tiny model's runner (its KV written for real), with logits rewritten so greedy
    decoding picks ``script[position]`` at every output position it samples."""

    def __init__(self, runner: ModelRunner, script: list[int]) -> None:
        self.runner, self.script = runner, script
        self.kv_cache = runner.kv_cache
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        logits = self.runner.execute(batch).clone()
        end = 0
        for i, (seq, rows) in enumerate(zip(batch.seqs, batch.logit_rows, strict=True)):
            end += rows
            for j in range(len(batch.drafts[i]) + 1) if batch.samples[i] else ():
                row = logits[end - len(batch.drafts[i]) - 1 + j]
                row.fill_(0.0)
                row[self.script[seq.num_output_tokens + j]] = 1.0
        self.batches.append(batch)
        return logits


def verified_blocks_only(engine: Engine, seq: Sequence) -> None:
    """A running sequence holds blocks up to its next token's, no more (rejected drafts'
    blocks went back), and exactly its full computed blocks are published, each holding
    the sequence's own tokens."""
    bs = engine.config.block_size
    cache = engine.block_manager.prefix_cache
    assert cache is not None
    assert len(seq.block_table) <= seq.num_computed_tokens // bs + 1
    published = [b for b in seq.block_table if cache.is_published(b)]
    assert len(published) == seq.num_published_blocks == seq.num_computed_tokens // bs
    for i, block in enumerate(published):
        assert cache.entry(block).token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])


def test_rejected_drafts_roll_back_and_only_verified_blocks_are_published() -> None:
    """The prompt repeats ``10..17``; the script continues the pattern for 9 tokens, then
    breaks it twice: drafts are kept while it follows, the one breaking it is rejected and
    its blocks (4 tokens a block) return; the answer is the script, the pool whole again."""
    config = tiny(
        block_size=4,
        num_blocks=24,
        speculation=SpeculationOptions(max_draft_tokens=6, adaptive=False),
    )
    pattern = list(range(10, 18))
    script = (pattern * 3)[:9] + [40, 41] + pattern[:6] + [42]
    runner = Scripted(ModelRunner(config), script)
    engine = Engine(config, runner=runner)
    free_before = engine.block_manager.allocator.num_free
    engine.add_request("r", pattern * 2, SamplingParams(max_tokens=len(script)))
    seq = engine._seqs["r"]
    out_tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            out_tokens += out.new_token_ids
        engine.check_invariants()
        if not seq.is_finished:
            verified_blocks_only(engine, seq)
    assert out_tokens == script
    stats = engine.stats()
    assert stats.draft_tokens > stats.accepted_draft_tokens > 0  # kept some, rejected some
    assert stats.steps < len(script)  # drafts saved steps
    assert stats.generation_tokens == len(script)
    engine.check_invariants(idle=True)
    cache = engine.block_manager.prefix_cache
    assert cache is not None
    allocator = engine.block_manager.allocator
    assert allocator.num_free + allocator.num_cached == free_before
    assert any(len(d) > 1 for b in runner.batches for d in b.drafts)


def test_drafts_take_only_the_budget_left_and_free_blocks() -> None:
    """A 12-token budget: a new prompt's chunk is scheduled before any draft, and a draft
    never evicts a cached block to find room."""
    config = tiny(
        block_size=4,
        num_blocks=16,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        speculation=SpeculationOptions(max_draft_tokens=8, adaptive=False),
    )
    pattern = list(range(10, 18))
    runner = Scripted(ModelRunner(config), pattern * 4)
    engine = Engine(config, runner=runner)
    engine.add_request("a", pattern * 2, SamplingParams(max_tokens=24))
    for _ in range(3):
        engine.step()
    engine.add_request("b", [3, 4, 5, 6, 7, 8, 9, 19, 20, 21, 22], SamplingParams(max_tokens=2))
    engine.step()
    batch = runner.batches[-1]
    b = next(i for i, s in enumerate(batch.seqs) if s.request_id == "b")
    assert batch.num_new_tokens[b] == 11  # its whole prompt, before any draft
    assert batch.num_tokens <= 12 and not any(batch.drafts)  # the decode drafted nothing
    assert len(runner.batches[-2].drafts[0]) >= 2  # as it did the step before
    while engine.has_unfinished_requests():
        evictions = engine.stats().evictions
        engine.step()
        engine.check_invariants()
        drafted = runner.batches[-1].num_draft_tokens
        assert not drafted or engine.stats().evictions == evictions


# -- SmolLM2 in the dtype served -----------------------------------------------------------------


class Rows:
    """The real runner; keeps a digest of the logits row behind each output position."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.kv_cache = runner, runner.kv_cache
        self.rows = RowsByPosition()
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        logits = self.runner.execute(batch)
        self.batches.append(batch)
        self.rows.keep(
            batch, logits, lambda r: hashlib.blake2b(r.numpy().tobytes(), digest_size=16).digest()
        )
        return logits


Result = list[tuple[list[int], object, list[bytes]]]  # tokens, logprobs, row digests


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(EngineConfig(model=SMOLLM2, dtype="auto", num_blocks=768))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = checkpoint_for(SMOLLM2).tokenizer()
    copy = encode(tokenizer, "You are an editor.", "Repeat this report exactly:\n" + LONG_DOCUMENT)
    return [*chat_prompts(tokenizer), copy]


def engine_with(runner: ModelRunner, speculation: SpeculationOptions, **config) -> Engine:
    fields = {"num_blocks": 768, **config}
    config = EngineConfig(model=SMOLLM2, dtype="auto", speculation=speculation, **fields)
    return Engine(config, runner=Rows(runner))


def run_all(engine: Engine, prompts, params) -> Result:
    """Every prompt added at once, stepped to the end, accounting checked after each step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    outs: dict[str, tuple[list[int], list]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens, logprobs = outs.setdefault(o.request_id, ([], []))
            tokens += o.new_token_ids
            logprobs += o.logprobs or []
        engine.check_invariants()
    engine.check_invariants(idle=True)
    rows = engine.runner.rows  # type: ignore[attr-defined]
    return [
        (*outs[f"r{i}"], rows.upto(f"r{i}", len(outs[f"r{i}"][0]))) for i in range(len(prompts))
    ]


def assert_same(result: Result, reference: Result) -> None:
    for i, ((tokens, logprobs, rows), (t0, lp0, r0)) in enumerate(
        zip(result, reference, strict=True)
    ):
        assert tokens == t0, f"prompt {i}: tokens differ"
        assert logprobs == lp0, f"prompt {i}: logprobs differ"
        assert rows == r0, f"prompt {i}: logits rows differ"


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    max_tokens=NEW_TOKENS,
    ignore_eos=True,
    temperature=0.7,
    seed=11,
    logprobs=2,
    repetition_penalty=1.05,
    frequency_penalty=0.1,
)
PLAIN = SpeculationOptions(enabled=False)


def fixed(k: int) -> SpeculationOptions:
    return SpeculationOptions(max_draft_tokens=k, adaptive=False)


@pytest.fixture(scope="module")
def plain_greedy(runner, prompts) -> Result:
    return run_all(engine_with(runner, PLAIN), prompts, GREEDY)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [SERVED])
def test_greedy_tokens_logprobs_and_rows_are_plain_decodings(
    runner, prompts, plain_greedy, k, dtype
) -> None:
    engine = engine_with(runner, fixed(k))
    result = run_all(engine, prompts, GREEDY)
    stats = engine.stats()
    assert stats.draft_tokens > stats.accepted_draft_tokens > 0, stats  # kept and rejected
    assert max(len(d) for b in engine.runner.batches for d in b.drafts) == k
    assert_same(result, plain_greedy)


@pytest.fixture(scope="module")
def plain_seeded(runner, prompts) -> Result:
    return run_all(engine_with(runner, PLAIN), prompts, SEEDED)


# every fixed length is held to plain greedy decoding above; sampling adds the seeded
# generators and penalties, which a draft of one, of eight and of an adapting length cover
# (2 and 4, 25 s of the suite, take the same accept and roll-back paths as eight)
@pytest.mark.parametrize("k", [1, 8, "adaptive"])
@pytest.mark.parametrize("dtype", [SERVED])
def test_seeded_sampling_with_penalties_is_plain_decodings(
    runner, prompts, plain_seeded, k, dtype
) -> None:
    engine = engine_with(runner, SpeculationOptions() if k == "adaptive" else fixed(k))
    result = run_all(engine, prompts, SEEDED)
    stats = engine.stats()
    assert stats.draft_tokens > stats.accepted_draft_tokens > 0, stats
    assert_same(result, plain_seeded)


@pytest.mark.parametrize("dtype", [SERVED])
def test_batched_with_requests_that_opt_out(runner, prompts, plain_greedy, dtype) -> None:
    """Every other request says ``speculate: false``: the steps mix decodes with and
    without drafts, and every request still gets plain decoding's tokens."""
    params = [GREEDY.model_copy(update={"speculate": i % 2 == 0}) for i in range(len(prompts))]
    engine = engine_with(runner, SpeculationOptions())
    assert_same(run_all(engine, prompts, params), plain_greedy)
    mixed = [
        b
        for b in engine.runner.batches
        if any(b.drafts)
        and any(not d and n == 1 for d, n in zip(b.drafts, b.num_new_tokens, strict=True))
    ]
    assert mixed
    drafted = {
        s.request_id
        for b in engine.runner.batches
        for s, d in zip(b.seqs, b.drafts, strict=True)
        if d
    }
    assert drafted and all(int(r[1:]) % 2 == 0 for r in drafted)


@pytest.mark.parametrize("dtype", [SERVED])
def test_preempted_between_drafts(runner, prompts, plain_greedy, dtype) -> None:
    """A pool too small for all prompts at once: sequences that had drafts are preempted,
    recomputed, draft again, and end with plain decoding's tokens."""
    engine = engine_with(runner, fixed(4), num_blocks=110, max_num_seqs=9, decode_reserve=False)
    result = run_all(engine, prompts, GREEDY)
    batches = engine.runner.batches
    drafted_before = [
        seq
        for i, b in enumerate(batches)
        for seq in b.preempted
        if any(s is seq and d for e in batches[:i] for s, d in zip(e.seqs, e.drafts, strict=True))
    ]
    assert drafted_before, "no sequence was preempted after drafting"
    assert_same(result, plain_greedy)


@pytest.mark.parametrize("dtype", [SERVED])
def test_held_to_json_with_drafts(runner, prompts, dtype) -> None:
    """Quoting the report inside a JSON object: the grammar masks every verified row as
    it masks a decoded one, and drafts that the grammar's token differs from are rejected."""
    quote = StructuredOutput(
        kind="json_schema",
        schema_text='{"type": "object", "properties": {"quote": {"type": "string"}}, '
        '"required": ["quote"]}',
    )
    params = [
        SamplingParams(max_tokens=64, structured=quote, logprobs=1),
        SamplingParams(max_tokens=64, structured=quote, temperature=0.5, seed=5),
    ]
    cases = [prompts[-1], prompts[-1]]
    reference = run_all(engine_with(runner, PLAIN), cases, params)
    engine = engine_with(runner, SpeculationOptions())
    result = run_all(engine, cases, params)
    assert engine.stats().accepted_draft_tokens > 0
    assert_same(result, reference)
