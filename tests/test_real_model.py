"""SmolLM2-135M-Instruct: our engine computes exactly what transformers computes.

The reference is ``transformers.LlamaForCausalLM`` (transformers 5.24, the version pinned in
pyproject.toml) holding the same dequantized float32 weights, decoded by plain argmax over its
logits (a loop with its KV cache, not ``generate``, which would read the checkpoint's
generation config). Every case compares 32 greedy tokens per prompt, token for token, and the
logits of every position within 1e-3.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from chat_prompts import chat_prompts
from conftest import RowsByPosition, transformers_greedy
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.checkpoints.hf import hf_config
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.engine.step import ScheduledBatch
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
LOGIT_TOLERANCE = 1e-3


class Recording:
    """The real model runner, recording each step's logits per request."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.logits = RowsByPosition()
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        logits = self.runner.execute(batch)
        self.batches.append(batch)
        self.logits.keep(batch, logits, torch.Tensor.clone)
        return logits


@pytest.fixture(scope="module")
def checkpoint():
    return checkpoint_for(SMOLLM2)


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    return chat_prompts(checkpoint.tokenizer())


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(EngineConfig(model=SMOLLM2, dtype="float32", num_blocks=512))


@pytest.fixture(scope="module")
def hf_model(checkpoint) -> HFLlama:
    state = checkpoint.state_dict()
    model = HFLlama(LlamaConfig(**hf_config(checkpoint.shape))).eval()
    model.load_state_dict({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    return model


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy tokens and per-position logits for every prompt."""
    return transformers_greedy(hf_model, prompts, NEW_TOKENS)


def engine_with(runner: ModelRunner, **config) -> tuple[Engine, Recording]:
    recording = Recording(runner)
    config = {"dtype": "float32", "max_num_batched_tokens": 512, **config}
    return Engine(EngineConfig(model=SMOLLM2, **config), runner=recording), recording


def assert_matches(outs, recording: Recording, reference) -> None:
    for out, (tokens, logits) in zip(outs, reference, strict=True):
        assert out.token_ids == tokens
        ours = recording.logits[out.request_id][-NEW_TOKENS:]
        diffs = [float((a - b).abs().max()) for a, b in zip(ours, logits, strict=True)]
        assert max(diffs) < LOGIT_TOLERANCE, diffs


def test_the_prompts_cover_what_the_issue_asks(prompts) -> None:
    assert transformers.__version__.startswith("5.24")
    assert len(prompts) >= 8
    assert max(len(p) for p in prompts) > 1000
    assert len({len(p) for p in prompts}) == len(prompts)


def test_each_prompt_alone_equals_transformers(runner, prompts, reference) -> None:
    engine, recording = engine_with(runner, num_blocks=512)
    outs = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert_matches(outs, recording, reference)
    assert all(o.num_cached_tokens == 0 for o in outs[:2])


def test_a_cached_system_prompt_changes_nothing(runner, prompts, reference) -> None:
    engine, recording = engine_with(runner, num_blocks=512)
    engine.generate([prompts[1]], GREEDY)  # the shared system prompt is now cached
    outs = engine.generate(prompts, GREEDY)
    assert_matches(outs, recording, reference)
    assert all(outs[i].num_cached_tokens >= 512 for i in (1, 2, 3))


def test_eight_requests_batched_with_prefill_and_decode_in_one_step(
    runner, prompts, reference
) -> None:
    engine, recording = engine_with(runner, num_blocks=512)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids[:4], prompts[:4], strict=True):
        engine.add_request(rid, p, GREEDY)
    finished = {}
    for step in range(200):
        if step == 2:  # the first four are decoding: the rest prefill beside them
            for rid, p in zip(ids[4:], prompts[4:], strict=True):
                engine.add_request(rid, p, GREEDY)
        finished |= {o.request_id: o for o in engine.step() if o.finished}
        if len(finished) == len(ids):
            break
    assert any(b.num_decodes and b.num_prefill_tokens for b in recording.batches)
    assert_matches([finished[rid] for rid in ids], recording, reference)


def test_prompts_chunked_over_many_steps_change_nothing(runner, prompts, reference) -> None:
    engine, recording = engine_with(runner, num_blocks=512, max_num_batched_tokens=64)
    outs = engine.generate(prompts, GREEDY)
    assert max(b.num_tokens for b in recording.batches) <= 64
    partial = sum(b.samples.count(False) for b in recording.batches)  # chunks short of the end
    assert partial > 10
    assert_matches(outs, recording, reference)


def test_preemption_on_a_tiny_pool_changes_nothing(runner, prompts, reference) -> None:
    engine, recording = engine_with(runner, num_blocks=90, max_num_seqs=8)
    outs = engine.generate(prompts, GREEDY)
    assert engine.stats().preemptions > 0
    assert_matches(outs, recording, reference)
    engine.check_invariants()


def run_collecting_logprobs(engine: Engine, prompt: list[int], params: SamplingParams):
    """The output tokens, their logprobs, and the prompt's logprobs, by stepping."""
    engine.add_request("scored", prompt, params)
    tokens, logprobs, prompt_logprobs = [], [], None
    while True:
        (out,) = [o for o in engine.step() if o.request_id == "scored"] or [None]
        if out is None:
            continue
        tokens += out.new_token_ids
        logprobs += out.logprobs or []
        prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        if out.finished:
            return tokens, logprobs, prompt_logprobs


def assert_logprobs_equal(entries, targets: list[int], logits: list[torch.Tensor]) -> None:
    """Each entry equals transformers' log-softmax at its token, and its alternatives are
    transformers' five most likely tokens, within 1e-4."""
    assert len(entries) == len(targets) == len(logits)
    for entry, target, row in zip(entries, targets, logits, strict=True):
        want = torch.log_softmax(row.float(), dim=-1)
        assert entry.token_id == target
        assert entry.logprob == pytest.approx(float(want[target]), abs=1e-4)
        top = want.topk(5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_equal_transformers_log_softmax(runner, prompts, reference, hf_model) -> None:
    engine, _ = engine_with(runner, num_blocks=512)
    engine.generate([prompts[1]], GREEDY)  # the system prompt is cached: scoring recomputes it
    params = GREEDY.model_copy(update={"logprobs": 5, "prompt_logprobs": 5})
    prompt = prompts[2]
    tokens, logprobs, prompt_logprobs = run_collecting_logprobs(engine, prompt, params)
    want_tokens, want_logits = reference[2]
    assert tokens == want_tokens
    assert_logprobs_equal(logprobs, tokens, want_logits)
    with torch.inference_mode():
        prompt_logits = hf_model(torch.tensor([prompt])).logits[0]
    assert prompt_logprobs[0] is None  # nothing predicts the first token
    assert_logprobs_equal(prompt_logprobs[1:], prompt[1:], list(prompt_logits[:-1]))
    engine.check_invariants()
