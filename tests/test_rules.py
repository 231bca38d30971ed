"""Rules the README states that no end-to-end test would see break, each held at the
fastest level that can see it: the sampler on fixed logits with seeded draws, the engine
resuming a request without Ray, the router's bookkeeping without Ray or Redis, the
ingress's salts, the index's circuit breaker."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import tiny
from starlette.requests import Request

from bench.harness.redis_server import free_port
from cluster.api.models import CompletionRequest
from cluster.config import ClusterArgs
from cluster.engine_stream import EngineStream
from cluster.request_builder import RequestBuilder
from kvindex.config import IndexConfig
from kvindex.reader import IndexReader
from kvindex.records import RoutingRequest
from replica.messages import EngineRequest
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams
from replica.sampling.sampler import Sampler, SampleRow, position_seed
from router.config import make_policy, routing_config
from router.core import RoutingCore
from router.recent_routes import RecentRoutes

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])
DRAWS = 4000


def seq(params: SamplingParams, output: list[int] = (), rid: str = "r") -> SampleRow:
    """One row to sample: a prompt of the least likely token, then ``output``."""
    return SampleRow(rid, params, [3, *output], num_prompt_tokens=1)


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """How often each token is drawn over ``DRAWS`` seeds (each draw seeded, so exact)."""
    sampler = Sampler(seed=0)
    counts = torch.zeros(len(logits))
    for seed in range(DRAWS):
        drawn = sampler.sample_one(logits, seq(params.model_copy(update={"seed": seed})))
        counts[drawn.token_id] += 1
    return counts / DRAWS


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_temperature_divides_the_logits(temperature: float) -> None:
    want = torch.softmax(LOGITS / temperature, dim=-1)
    got = frequencies(SamplingParams(temperature=temperature))
    # 4,000 draws: a frequency's standard error is at most 0.008; 4 of them apart fails
    assert torch.allclose(got, want, atol=0.03), (got, want)


def test_top_p_keeps_the_smallest_head_that_reaches_it() -> None:
    probs = torch.softmax(LOGITS, dim=-1)  # 0.644, 0.237, 0.087, 0.032
    got = frequencies(SamplingParams(temperature=1.0, top_p=0.8))
    head = probs[:2] / probs[:2].sum()
    assert got[2:].sum() == 0 and torch.allclose(got[:2], head, atol=0.03)


@pytest.mark.parametrize(
    ("penalty", "value"),
    [("presence_penalty", 2.0), ("frequency_penalty", 1.5), ("repetition_penalty", 4.0)],
)
def test_each_penalty_alone_turns_greedy_away_from_a_repeated_token(
    penalty: str, value: float
) -> None:
    """Token 0 leads by 1.0 and was generated twice: each penalty, sent alone, must make
    greedy pick token 1 instead (a gate that skipped processing for it would not)."""
    sampler = Sampler(seed=0)
    plain = SamplingParams(temperature=0.0)
    assert sampler.sample(LOGITS.unsqueeze(0), [seq(plain, [0, 0])])[0].token_id == 0
    penalised = SamplingParams(temperature=0.0, **{penalty: value})
    assert sampler.sample(LOGITS.unsqueeze(0), [seq(penalised, [0, 0])])[0].token_id == 1
    assert sampler.sample(LOGITS.unsqueeze(0), [seq(penalised, [])])[0].token_id == 0


def test_a_repetition_penalty_of_2_alone_is_applied_like_any_other_but_1() -> None:
    """The gate skips processing only at a repetition penalty of exactly 1.0 (no-op):
    2.0 halves token 0's lead of 2.0 to 1.0, below token 1's 1.5."""
    logits = torch.tensor([2.0, 1.5, 0.0, -1.0])
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler(seed=0).sample(logits.unsqueeze(0), [seq(penalised, [0])])[0].token_id == 1


def test_frequency_penalty_counts_every_occurrence_presence_only_one() -> None:
    logits = torch.tensor([2.0, 0.5])
    sampler = Sampler(seed=0)
    once, thrice = [0], [0, 0, 0]
    presence = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sampler.sample(logits.unsqueeze(0), [seq(presence, thrice)])[0].token_id == 0
    frequency = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert sampler.sample(logits.unsqueeze(0), [seq(frequency, once)])[0].token_id == 0
    assert sampler.sample(logits.unsqueeze(0), [seq(frequency, thrice)])[0].token_id == 1


def test_a_resumed_request_counts_its_delivered_tokens_as_output() -> None:
    """Resuming (what failover sends): the delivered tokens are output, so ``max_tokens``,
    usage and the sampler's positions go on where they stopped, and the rest of the
    stream is what the request alone would have produced."""
    engine = build_engine(tiny(num_blocks=128))
    prompt = list(range(40, 70))
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    (whole,) = engine.generate([prompt], params)
    delivered = whole.token_ids[:5]
    engine.add_request("resumed", prompt, params, output_token_ids=delivered)
    outputs = []
    while not outputs or not outputs[-1].finished:
        outputs += [o for o in engine.step() if o.request_id == "resumed"]
    last = outputs[-1]
    assert last.num_prompt_tokens == len(prompt)
    assert last.token_ids == whole.token_ids  # 5 delivered + 7 new: max_tokens counted once
    new = [t for o in outputs for t in o.new_token_ids]
    assert new == whole.token_ids[5:]
    engine.check_invariants(idle=True)


def test_log_probabilities_are_never_positive_and_sum_to_one() -> None:
    """A check that can fail: the raw log-softmax of the logits at each sampled token."""
    sampler = Sampler(seed=0)
    out = sampler.sample(LOGITS.unsqueeze(0), [seq(SamplingParams(temperature=0.0, logprobs=4))])
    logprob = out[0].logprob
    assert logprob is not None and logprob.logprob == pytest.approx(
        float(torch.log_softmax(LOGITS, -1)[0]), abs=1e-6
    )
    total = sum(math.exp(v) for _, v in logprob.top)
    assert total == pytest.approx(1.0, abs=1e-5)


def test_a_draw_seed_takes_the_request_seed_modulo_2_63_and_is_pinned() -> None:
    """The request seed counts modulo 2**63, and each draw's seed is pinned across releases."""
    assert position_seed(5, 0) == position_seed(5 + 2**63, 0)
    assert position_seed(-1, 3) == position_seed(2**63 - 1, 3)
    assert position_seed(0, 0) == 2928822574489494037
    assert position_seed(7, 3) == 6579903082405569959


def test_each_draw_uses_a_generator_seeded_by_the_seed_and_its_position() -> None:
    """Position i draws with a generator seeded position_seed(seed, i) from the tempered softmax."""
    logits = torch.linspace(0.0, 1.0, 16)
    params = SamplingParams(temperature=0.7, seed=11)
    sampler = Sampler(seed=0)
    drawn = []
    for position in range(12):
        got = sampler.sample_one(logits, seq(params, [0] * position)).token_id
        gen = torch.Generator().manual_seed(position_seed(11, position))
        want = int(torch.multinomial(torch.softmax(logits / 0.7, -1), 1, generator=gen))
        assert got == want
        drawn.append(got)
    assert len(set(drawn)) > 1


def test_an_unseeded_request_draws_from_the_engine_seed_and_its_request_id() -> None:
    """Without params.seed, the engine seed and the request id fix the draws, and only they."""
    logits = torch.zeros(64)
    params = SamplingParams(temperature=1.0)

    def tokens(engine_seed: int, rid: str) -> list[int]:
        sampler = Sampler(seed=engine_seed)
        return [sampler.sample_one(logits, seq(params, [0] * i, rid)).token_id for i in range(8)]

    assert tokens(7, "a") == tokens(7, "a")
    assert tokens(7, "a") != tokens(8, "a")
    assert tokens(7, "a") != tokens(7, "b")


def test_temperature_1e_5_still_samples_and_below_it_is_greedy() -> None:
    """MIN_TEMPERATURE itself samples; any temperature below it is greedy."""
    tied = torch.tensor([[0.0, 0.0]])

    def drawn(temperature: float) -> set[int]:
        sampler = Sampler(seed=0)
        params = [SamplingParams(temperature=temperature, seed=s) for s in range(16)]
        return {sampler.sample(tied, [seq(p)])[0].token_id for p in params}

    assert drawn(1e-5) == {0, 1}
    assert drawn(0.99e-5) == {0}


class OnlyToken:
    """A grammar that allows one token (the sampler needs only ``mask``)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = torch.arange(len(logits)) == self.token
        return torch.where(allowed, logits, torch.full_like(logits, -torch.inf))


def test_the_grammar_mask_decides_the_token_and_logprobs_stay_raw() -> None:
    """A grammar's mask decides the token, and its logprob is still the raw log-softmax."""
    s = replace(seq(SamplingParams(temperature=0.0, logprobs=0)), grammar=OnlyToken(2))
    (out,) = Sampler(seed=0).sample(LOGITS.unsqueeze(0), [s])
    assert out.token_id == 2
    assert out.logprob is not None
    assert out.logprob.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[2]), abs=1e-6)


def test_a_greedy_row_with_a_grammar_is_masked_not_taken_from_the_plain_argmax() -> None:
    """Greedy rows without logprobs or processing take a batched argmax: never one with a
    grammar, whose mask must still decide the token."""
    assert int(LOGITS.argmax()) != 2
    s = replace(seq(SamplingParams(temperature=0.0)), grammar=OnlyToken(2))
    (out,) = Sampler(seed=0).sample(LOGITS.unsqueeze(0), [s])
    assert out.token_id == 2


def test_top_p_stops_at_a_head_whose_mass_reaches_it_exactly() -> None:
    """top_p keeps the smallest head whose mass reaches it, exactly at the edge."""
    tied = torch.tensor([0.0, 0.0])
    sampler = Sampler(seed=0)
    drawn = {
        sampler.sample_one(tied, seq(SamplingParams(temperature=1.0, top_p=0.5, seed=s))).token_id
        for s in range(32)
    }
    assert len(drawn) == 1
    both = {
        sampler.sample_one(tied, seq(SamplingParams(temperature=1.0, seed=s))).token_id
        for s in range(32)
    }
    assert both == {0, 1}


# --- the router's bookkeeping, without Ray or Redis ---


def routing_request(rid: str, tokens: int = 100, blocks: int = 6) -> RoutingRequest:
    chain = [bytes([i]) * 16 for i in range(blocks)]
    return RoutingRequest(rid, chain, chain[0], tokens, 16, max_tokens=20)


def test_a_released_booking_leaves_no_load_behind() -> None:
    core = RoutingCore(make_policy(routing_config()), RecentRoutes())
    request = routing_request("a")
    states = core.states(["r1", "r2"], None, request.block_hashes)
    booking = core.routed(core.decide(request, states), "r1")
    assert booking.prefill_tokens == 100 and len(core.bookings) == 1
    (r1,) = [s for s in core.states(["r1"], None, []) if s.replica_id == "r1"]
    assert (r1.in_flight, r1.prefill_tokens) == (1, 100)
    assert r1.decode_blocks == request.decode_blocks
    core.prefill_done("a")  # the prompt no longer loads it; the request still does
    (r1,) = core.states(["r1"], None, [])
    assert (r1.in_flight, r1.prefill_tokens) == (1, 0)
    assert core.release("a", "r2") is None  # a late callback of another attempt: kept
    assert core.release("a", "r1") == replace(booking, prefill_tokens=0)
    (r1,) = core.states(["r1"], None, [])
    assert (r1.in_flight, r1.prefill_tokens, r1.decode_blocks) == (0, 0, 0)
    assert len(core.bookings) == 0


def test_the_router_records_where_it_sent_a_prefix_for_when_the_index_is_late() -> None:
    core = RoutingCore(make_policy(routing_config()), RecentRoutes())
    request = routing_request("a")
    states = core.states(["r1", "r2"], None, request.block_hashes)
    core.routed(core.decide(request, states), "r2")
    # the index does not answer: the next request with that prefix sees it predicted on r2
    later = routing_request("b")
    seen = {
        s.replica_id: s.predicted_blocks
        for s in core.states(["r1", "r2"], None, later.block_hashes)
    }
    assert seen == {"r1": 0, "r2": 6}
    core.drop_replica("r2")
    seen = {
        s.replica_id: s.predicted_blocks
        for s in core.states(["r1", "r2"], None, later.block_hashes)
    }
    assert seen == {"r1": 0, "r2": 0}


# --- salts: the ingress's, and a resumed stream's ---


def http_request(key: str | None, salt_header: str | None = None) -> Request:
    headers = []
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if salt_header is not None:
        headers.append((b"x-cache-salt", salt_header.encode()))
    return Request({"type": "http", "headers": headers})


@pytest.mark.parametrize("share", [False, True])
def test_with_api_keys_a_requests_salt_has_its_key_and_its_own_salt(share: bool) -> None:
    args = ClusterArgs(engine=tiny(), api_keys=["k1", "k2"], share_cache_across_keys=share)
    builder = RequestBuilder(args, args.engine.block_hasher())

    def salt(key: str, own: str | None) -> str | None:
        body = CompletionRequest(model="tiny-llama-6m", prompt="x", cache_salt=own)
        return builder.cache_salt(body, http_request(key))

    if share:  # keys share: only the client's own salt separates
        assert salt("k1", None) is None and salt("k1", "t") == salt("k2", "t") == "t"
        return
    assert salt("k1", None) != salt("k2", None)  # keys never share
    assert salt("k1", "t1") != salt("k1", "t2")  # a key's tenants do not either
    assert salt("k1", "t1") != salt("k1", None) and salt("k1", "t1") == salt("k1", "t1")


def test_a_resumed_stream_is_rehashed_under_its_salt() -> None:
    hasher = tiny().block_hasher()
    prompt, delivered = list(range(40)), list(range(100, 120))
    route = routing_request("a")
    request = EngineRequest(
        request_id="a",
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=30),
        route=route,
        cache_salt="tenant",
    )
    stream = EngineStream(None, request, hasher.chain, max_resumes=2)  # type: ignore[arg-type]
    stream._delivered = delivered
    again = stream._continuation()
    assert again.route.block_hashes == hasher.chain(prompt + delivered, "tenant")
    assert again.route.block_hashes != hasher.chain(prompt + delivered, None)
    assert again.output_token_ids == delivered and again.cache_salt == "tenant"


# --- the index's circuit breaker ---


def test_the_index_breaker_trips_after_three_failed_queries_in_a_row() -> None:
    closed = IndexConfig(
        url=f"redis://127.0.0.1:{free_port()}/0",
        timeout_s=0.05,
        connect_timeout_s=0.05,
        retry_after_s=60.0,
    )
    reader = IndexReader(closed, "m")
    for asked in range(1, 4):  # three failures, each one asked for
        assert reader.query([b"x" * 16]) is None
        assert (reader.counters.query_failures, reader.counters.queries_skipped) == (asked, 0)
    assert reader.query([b"x" * 16]) is None  # the fourth is not asked
    assert (reader.counters.query_failures, reader.counters.queries_skipped) == (3, 1)
