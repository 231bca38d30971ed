"""n choices, logprobs, prompt logprobs, penalties, logit bias and min_tokens in the engine,
against plain reference implementations on fixed logits."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import tiny

from replica.engine.engine import Engine
from replica.engine.step import ScheduledBatch
from replica.model.runner import ModelRunner, build_engine
from replica.sampling.logits_processing import process_logits
from replica.sampling.params import SamplingParams
from replica.sampling.sampler import token_logprobs

PROMPT = [256, *b"The forecast for tomorrow says"]  # 31 tokens: a partial last block


def reference_processing(
    logits: list[float], params: SamplingParams, prompt: list[int], output: list[int], ends
) -> list[float]:
    """The rules as the docs state them, one token at a time, no tensors."""
    out = list(logits)
    if len(output) < params.min_tokens:
        for t in {*ends, *params.stop_token_ids}:
            out[t] = -math.inf
    for t, bias in params.logit_bias.items():
        out[t] += bias
    for t in set(prompt) | set(output):
        p = params.repetition_penalty
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return [min(max(v, -1e30), 1e30) for v in out]  # finite, so softmax never sees inf


@pytest.mark.parametrize("seed", range(6))
def test_logits_processing_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab = 12
    logits = [rng.uniform(-3, 3) for _ in range(vocab)]
    prompt = [rng.randrange(vocab) for _ in range(5)]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
    params = SamplingParams(
        min_tokens=rng.choice([0, 3, 8]),
        logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(2)},
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        frequency_penalty=rng.uniform(-1, 1),
        presence_penalty=rng.uniform(-1, 1),
        stop_token_ids=(rng.randrange(vocab),),
    )
    got = process_logits(torch.tensor(logits), params, prompt, output, [vocab - 1]).tolist()
    want = reference_processing(logits, params, prompt, output, [vocab - 1])
    assert got == pytest.approx(want, rel=1e-6, abs=1e-5)


def test_min_tokens_bans_every_end_id_from_0_and_skips_ids_outside_the_vocabulary() -> None:
    """min_tokens bans each end id in [0, vocab), token 0 too; ids outside it are skipped."""
    params = SamplingParams(min_tokens=1, stop_token_ids=(-1, 4))
    logits = torch.tensor([0.5, 1.0, 2.0, 3.0])
    got = process_logits(logits, params, [1], [], [0])
    assert torch.equal(got, torch.tensor([-1e30, 1.0, 2.0, 3.0]))  # -inf, bounded
    assert torch.equal(process_logits(logits, params, [1], [2], [0]), logits)


def test_zero_logprobs_report_the_token_with_an_empty_tuple_of_alternatives() -> None:
    """logprobs=0 reports the token's log-probability with top == (), never None."""
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    (entry,) = token_logprobs(logits, [1], 0)
    assert entry.token_id == 1 and entry.top == ()
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]), abs=1e-6)


def test_n_choices_share_one_prefill_and_equal_separate_seeded_requests() -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=4, ignore_eos=True)
    engine = build_engine(tiny())
    outs = engine.generate_choices(PROMPT, params)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    # one prefill of the prompt, then 11 decode tokens per choice
    assert engine.stats().computed_tokens == len(PROMPT) + 4 * 11
    separate = [
        build_engine(tiny()).generate([PROMPT], params.for_choice(i))[0].token_ids for i in range(4)
    ]
    assert [o.token_ids for o in outs] == separate
    assert len({tuple(o.token_ids) for o in outs}) == 4
    engine.check_invariants()
    assert engine.stats().blocks_in_use == 0


def test_choices_survive_a_pool_with_no_block_for_the_copy() -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True)
    engine = build_engine(tiny(num_blocks=4, block_size=16))  # 2 for the prompt, 2 left
    reference = build_engine(tiny()).generate_choices(PROMPT, params)
    outs = engine.generate_choices(PROMPT, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    engine.check_invariants()


class Recording:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.logits: list[torch.Tensor] = []

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        logits = self.runner.execute(batch)
        self.logits.append(logits.clone())
        return logits


def test_logprobs_are_the_raw_log_softmax_at_each_sampled_token() -> None:
    config = tiny()
    recording = Recording(ModelRunner(config))
    engine = Engine(config, runner=recording)
    params = SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True, repetition_penalty=1.5)
    engine.add_request("r", PROMPT, params)
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.logprobs
    assert len(got) == 5
    for step_logits, entry in zip(recording.logits, got, strict=True):
        raw = torch.log_softmax(step_logits[-1], dim=-1)
        assert entry.logprob == pytest.approx(float(raw[entry.token_id]), abs=1e-6)
        top_ids = raw.topk(3).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids
        assert [lp for _, lp in entry.top] == pytest.approx(raw.topk(3).values.tolist())


def test_prompt_logprobs_score_every_prompt_token_even_when_cached() -> None:
    config = tiny(max_num_batched_tokens=16, max_num_seqs=4)  # two chunks
    engine = build_engine(config)
    engine.generate([PROMPT], SamplingParams(max_tokens=1))  # its first block is cached now
    before = engine.stats().computed_tokens
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    out = engine.generate([PROMPT], params)[0]
    assert engine.stats().computed_tokens - before == len(PROMPT)  # recomputed whole
    assert out.num_cached_tokens == 0
    scores = out.prompt_logprobs
    assert scores[0] is None and len(scores) == len(PROMPT)
    # the same scores from a plain forward over the whole prompt
    runner = ModelRunner(tiny(enable_prefix_cache=False))
    whole = Engine(tiny(enable_prefix_cache=False), runner=runner)
    whole.generate([PROMPT], params)
    reference = whole_prompt_logprobs(runner, PROMPT)
    for entry, token, want in zip(scores[1:], PROMPT[1:], reference, strict=True):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(want, abs=1e-4)
        assert len(entry.top) == 2


def whole_prompt_logprobs(runner: ModelRunner, prompt: list[int]) -> list[float]:
    """log p(prompt[j] | prompt[:j]) from one unchunked, uncached forward pass."""
    engine = Engine(tiny(enable_prefix_cache=False), runner=Recording(runner))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = engine.generate([prompt], params)[0]
    return [e.logprob for e in out.prompt_logprobs[1:]]


def test_min_tokens_hold_the_end_back_and_logit_bias_forces_a_token() -> None:
    engine = build_engine(tiny(model={"eos_token_ids": [65]}))
    forced = SamplingParams(max_tokens=8, logit_bias={65: 100.0})
    assert engine.generate([PROMPT], forced)[0].token_ids == [65]  # EOS at once
    held = SamplingParams(max_tokens=8, logit_bias={65: 100.0}, min_tokens=5)
    out = engine.generate([PROMPT], held)[0]
    assert 65 not in out.token_ids[:5] and out.token_ids[5] == 65
    assert out.finish_reason == "stop" and len(out.token_ids) == 6


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 2.0])
def test_extreme_parameters_sample_a_token_and_never_fail_the_step(temperature: float) -> None:
    # a repetition penalty of 5e-324 divides positive logits to infinity; the step must
    # still sample (it once raised inside torch.multinomial and stopped the engine loop)
    engine = build_engine(tiny())
    extreme = SamplingParams(
        max_tokens=4,
        temperature=temperature,
        repetition_penalty=5e-324,
        frequency_penalty=-2.0,
        logit_bias={1: 100.0, 2: -100.0},
        min_tokens=4,
        seed=3,
    )
    normal = SamplingParams(max_tokens=4, temperature=0.0)
    outs = engine.generate([PROMPT, PROMPT], [extreme, normal])
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert 2 not in outs[0].token_ids
    engine.check_invariants()


def test_a_penalty_that_underflows_float32_keeps_a_banned_seen_token_banned() -> None:
    # 5e-324 is 0 in float32, and a banned token's -inf times 0 is NaN: a NaN row once
    # raised in torch.multinomial and stopped the engine loop (schemathesis found it with
    # a JSON format, whose mask bans most of the prompt's tokens)
    params = SamplingParams(max_tokens=4, repetition_penalty=5e-324, min_tokens=4)
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2))
    out = process_logits(logits, params, PROMPT, [], end_ids=[PROMPT[3]])
    assert not out.isnan().any()
    assert out[PROMPT[3]] == -1e30  # still the lowest there is
    engine = build_engine(tiny(model={"eos_token_ids": [PROMPT[3]]}))
    sampled = SamplingParams(
        max_tokens=4, temperature=1.0, seed=1, repetition_penalty=5e-324, min_tokens=4
    )
    assert len(engine.generate([PROMPT], sampled)[0].token_ids) == 4
    engine.check_invariants()


def test_the_other_choices_go_on_when_choice_0_ends_on_its_first_token() -> None:
    """Choice 0 stops at its first token (a stop id only it samples): its blocks are
    released before the others fork from it, so they must recompute the prompt (from the
    prefix cache) instead of sharing blocks it no longer has; each still equals its own
    separate seeded request, and every block comes back."""
    base = SamplingParams(max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    first = [
        build_engine(tiny()).generate(
            [PROMPT], base.for_choice(i).model_copy(update={"max_tokens": 1})
        )
        for i in range(3)
    ]
    firsts = [out[0].token_ids[0] for out in first]
    assert firsts[0] not in firsts[1:]  # the seed makes choice 0's first token its own
    params = base.model_copy(update={"n": 3, "stop_token_ids": (firsts[0],)})
    engine = build_engine(tiny())
    outs = engine.generate_choices(PROMPT, params)
    assert len(outs[0].token_ids) == 1 and max(len(o.token_ids) for o in outs[1:]) == 5
    separate = [build_engine(tiny()).generate([PROMPT], params.for_choice(i))[0] for i in range(3)]
    assert [o.token_ids for o in outs] == [s.token_ids for s in separate]
    engine.check_invariants()
    assert engine.stats().blocks_in_use == 0


class Batches:
    """A runner that records each step's batch: its sequences and tokens."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sizes: list[tuple[int, int]] = []

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.sizes.append((len(batch.seqs), batch.num_tokens))
        return self.runner.execute(batch)


def test_choices_beyond_max_num_seqs_wait_and_no_step_runs_more() -> None:
    """n = 3 with room for 2 sequences a step: the third choice waits (and recomputes its
    prompt from the cache) instead of joining the running past the cap, so no batch holds
    more than 2 sequences or more tokens than the budget; every choice still equals its
    own seeded request."""
    config = tiny(max_num_seqs=2, max_num_batched_tokens=64)
    batches = Batches(ModelRunner(config))
    engine = Engine(config, runner=batches)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3, ignore_eos=True)
    outs = engine.generate_choices(PROMPT, params)
    assert max(n for n, _ in batches.sizes) == 2
    assert max(t for _, t in batches.sizes) <= 64
    separate = [build_engine(tiny()).generate([PROMPT], params.for_choice(i))[0] for i in range(3)]
    assert [o.token_ids for o in outs] == [s.token_ids for s in separate]
    engine.check_invariants()
    assert engine.stats().blocks_in_use == 0


def test_a_request_whose_own_sampling_fails_is_dropped_and_the_step_goes_on() -> None:
    """A failure of one request's own (here its grammar put past its end, which xgrammar
    refuses to mask: what a schemathesis run once hit in a replica) ends that request with
    finish_reason "error"; the batch's other requests get the very tokens they get alone,
    and every block comes back."""
    from replica.sampling.params import StructuredOutput

    engine = build_engine(tiny())
    alone = build_engine(tiny()).generate([PROMPT], SamplingParams(max_tokens=6))[0].token_ids
    held = SamplingParams(max_tokens=6, structured=StructuredOutput(kind="json_object"))
    engine.add_request("held", PROMPT, held)
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=6))
    grammar = engine._seqs["held"].grammar
    assert grammar is not None
    for token in b"{}":
        assert grammar.matcher.accept_token(token)
    assert grammar.matcher.accept_token(engine.config.shape.eos_token_ids[0])  # ended
    outputs: dict[str, list] = {"held": [], "free": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine.check_invariants()
    (failed,) = outputs["held"]
    assert failed.finish_reason == "error" and failed.finished
    assert "terminated" in (failed.error or "")
    assert [t for o in outputs["free"] for t in o.new_token_ids] == alone
    assert engine.stats().failed_requests == 1
    engine.check_invariants(idle=True)
