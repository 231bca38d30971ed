"""The parts of a move on engines alone (``replica.moves``): a decode stopped on one bfloat16
engine, its KV exported and imported into another, and continued there is the same stream
token for token and logprob for logprob as one never moved; block accounting adds up on
both; a leaving replica's hot prefixes are whole chains, hottest first, within their
budget; and the balancer's plan (``replica.balance.plan``) moves only what pays."""

from __future__ import annotations

from conftest import tiny

from replica.balance import Peer, plan
from replica.handoff import hot_prefixes
from replica.kv.transfer import export_prefix, import_prefix
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams, TokenLogprob

PROMPT = list(range(3, 3 + 75))  # 4 full blocks and a partial one
GREEDY = SamplingParams(max_tokens=40, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, logprobs=2, temperature=0.9, seed=5, ignore_eos=True)


def engine():  # type: ignore[no-untyped-def]
    return build_engine(tiny(dtype="bfloat16", deterministic=True, num_blocks=64, num_threads=1))


def run(e, rid: str, until: int | None = None) -> tuple[list[int], list[TokenLogprob]]:  # type: ignore[no-untyped-def]
    """Step ``e`` until ``rid`` finished (or has ``until`` tokens): its tokens, logprobs."""
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    while e.has_unfinished_requests() and (until is None or len(tokens) < until):
        for out in e.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
        e.check_invariants()
    return tokens, logprobs


def test_a_moved_decode_is_the_stream_never_moved_in_bfloat16() -> None:
    for params in (GREEDY, SEEDED):
        whole = engine()
        whole.add_request("r", PROMPT, params)
        want = run(whole, "r")
        source, target = engine(), engine()
        source.add_request("r", PROMPT, params)
        head, head_logprobs = run(source, "r", until=21)  # a full output block and then some
        detached = source.detach("r")
        assert detached is not None and detached[0] == PROMPT + head
        assert source.movable() == [] and not source.has_unfinished_requests()
        source.check_invariants(idle=True)  # nothing leaked: its blocks are free or cached
        export = export_prefix(source.kv, *detached)
        # prompt and output, but the last token's KV (computed by the step after it)
        assert len(export.blocks) == (len(PROMPT) + len(head) - 1) // 16 == 5
        result = import_prefix(target.kv, *detached, export)
        assert result.imported == len(export.blocks) and not result.rejected
        target.add_request("r", PROMPT, params, output_token_ids=head)  # the continuation
        tail, tail_logprobs = run(target, "r")
        assert target.metrics.num_aborted == source.metrics.num_aborted == 0  # moved
        assert head + tail == want[0]
        assert head_logprobs + tail_logprobs == want[1]  # bit for bit
        target.check_invariants(idle=True)


def test_only_one_choice_requests_are_movable_longest_left_first() -> None:
    e = engine()
    e.add_request("short", PROMPT, SamplingParams(max_tokens=10))
    e.add_request("long", PROMPT[:40], SamplingParams(max_tokens=30))
    e.add_request("pair", PROMPT[:20], SamplingParams(max_tokens=30, n=2, temperature=1.0))
    assert [rid for rid, _ in e.movable()] == ["long", "short"]
    assert e.movable(decoding=True) == []  # none has a token yet
    e.step()
    e.step()
    assert e.detach("pair") is None and e.detach("nobody") is None
    assert {rid for rid, _ in e.movable(decoding=True)} <= {"long", "short"}


def test_hot_prefixes_are_whole_chains_in_use_first_then_the_most_recent() -> None:
    e = engine()
    shared = list(range(100, 132))  # two blocks two prompts share
    e.add_request("old", shared + list(range(140, 173)), SamplingParams(max_tokens=1))
    run(e, "old")
    e.add_request("new", shared + list(range(180, 213)), SamplingParams(max_tokens=1))
    run(e, "new")
    e.add_request("held", list(range(200, 250)), SamplingParams(max_tokens=30))
    run(e, "held", until=2)  # still running: its blocks in use
    hot = hot_prefixes(e.kv, max_blocks=64)
    assert [p.token_ids[:16] for p in hot] == [
        list(range(200, 216)),
        shared[:16],
        shared[:16],
    ]
    assert [p.num_blocks for p in hot] == [3, 4, 4]
    assert hot[1].token_ids[32:] == list(range(180, 212))  # the newer of the two first
    assert all(len(p.token_ids) == 16 * p.num_blocks for p in hot)
    # a budget of 6 blocks: the held chain (3) and the newer (4, 2 shared: still 7) -> 1
    assert len(hot_prefixes(e.kv, max_blocks=6)) == 1
    assert hot_prefixes(e.kv, max_blocks=0) == []


PEERS = [Peer("idle", 1, 0, 1.0), Peer("busy", 9, 2, 1.0)]


def test_the_plan_moves_half_the_difference_to_an_idle_peer_when_it_pays() -> None:
    remaining = [300, 200, 150, 100, 60, 20]
    assert plan(9, remaining, PEERS, 0.09, 0.05, 32) == ("idle", 4)  # (9 - 1) // 2
    assert plan(9, remaining, PEERS[1:], 0.09, 0.05, 32) is None  # nobody idle
    assert plan(3, remaining, PEERS, 0.09, 0.05, 32) == ("idle", 1)
    assert plan(2, remaining, PEERS, 0.09, 0.05, 32) is None  # one apart is balanced
    assert plan(9, remaining, [Peer("idle", 1, 1, 1.0)], 0.09, 0.05, 32) is None  # it queues
    # 0.01 s a sequence a step: the first move saves 300 tokens * 0.01 s * (9 - 2) = 21 s,
    # the second 200 * 0.01 s * (8 - 3) = 10 s; and none has fewer than 32 tokens left
    assert plan(9, [300, 20, 10], PEERS, 0.09, 2.0, 32) == ("idle", 1)
    assert plan(9, [300, 200], PEERS, 0.09, 9.0, 32) == ("idle", 2)
    assert plan(9, [300, 200], PEERS, 0.09, 20.0, 32) == ("idle", 1)
    assert plan(9, [300, 200], PEERS, 0.09, 25.0, 32) is None
