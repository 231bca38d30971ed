"""A traced request (``add_request(traced=True)``: its restore and prompt chunks timed for
its replica's spans, ``replica.trace_spans``) is served exactly as an untraced one, in the
dtype we serve (bfloat16), and its times say what happened: one chunk per step that
computed part of its prompt, the chunks adding up to the prompt tokens it computed, in
order from its arrival to its last token."""

from __future__ import annotations

from conftest import tiny

from replica.messages import RequestOutput
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams, TokenLogprob

PROMPTS = [list(range(3, 3 + n)) for n in (150, 40, 97)]  # 64-token chunks: 3, 1 and 2
PARAMS = SamplingParams(max_tokens=12, logprobs=2)


def served(traced: bool) -> tuple[list[RequestOutput], list[list[TokenLogprob]]]:
    """The prompts together on a fresh bfloat16 engine (chunks of 64): each one's last
    output, and the logprobs of every token it produced."""
    engine = build_engine(tiny(dtype="bfloat16", max_num_batched_tokens=64, num_threads=1))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS, traced=traced)
    last: dict[str, RequestOutput] = {}
    logprobs: dict[str, list[TokenLogprob]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while len(last) < len(PROMPTS):
        for out in engine.step():
            logprobs[out.request_id] += out.logprobs or []
            if out.finished:
                last[out.request_id] = out
        engine.check_invariants()
    engine.check_invariants(idle=True)
    outputs = [last[f"r{i}"] for i in range(len(PROMPTS))]
    for out in outputs:
        assert len(logprobs[out.request_id]) == len(out.token_ids) == PARAMS.max_tokens
    return outputs, [logprobs[o.request_id] for o in outputs]


def test_a_traced_request_is_served_exactly_as_an_untraced_one_in_bfloat16() -> None:
    plain, plain_logprobs = served(traced=False)
    traced, traced_logprobs = served(traced=True)
    assert [o.token_ids for o in traced] == [o.token_ids for o in plain]
    assert traced_logprobs == plain_logprobs  # every token's, bit for bit
    assert all(o.times is None for o in plain)  # nothing timed unless traced


def test_a_traced_requests_times_follow_its_chunks() -> None:
    outputs, _ = served(traced=True)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        times = out.times
        assert times is not None
        computed = len(prompt) - out.num_cached_tokens
        assert sum(n for _, _, n in times.chunks) == computed
        assert len(times.chunks) >= -(-computed // 64)  # 64 at most each (a shared budget)
        assert times.scheduled == times.chunks[0][0]
        assert times.arrival <= times.scheduled
        ends = [end for _, end, _ in times.chunks]
        assert ends == sorted(ends) and times.first_token is not None
        assert ends[-1] <= times.first_token <= times.finished
        assert times.preemptions == 0 and times.restore_s == 0.0  # no node store here
