"""The pull rule (``kvindex.pulls``), as the replica, the router and the simulator use it:
who a replica pulls from, what the router charges for a pull, and the simulator's pulls."""

from __future__ import annotations

import pytest
from conftest import tiny
from test_policies import request, state

from bench.experiments.simulate import sim_policy, split_pull
from bench.sim.cost_model import CostModel
from bench.sim.simulator import Simulation
from bench.workloads import WorkloadSpec, make_trace, oracle_hit_rate
from kvindex.pulls import pull_price, pull_source, pulled_tokens, with_pullable
from kvindex.records import ReplicaTable
from replica.checkpoints.tokenizer import ByteTokenizer
from replica.pull_config import PullConfig
from router.config import make_policy, routing_config
from router.core import RoutingCore
from router.prefill_cost import CostKnobs, PrefillCost

PULL = PullConfig(enabled=True, min_blocks=2, token_cost=0.05, call_cost_tokens=20)


def test_a_replica_pulls_from_the_one_that_published_most_if_min_blocks_more() -> None:
    states = [state("a", cached_blocks=3), state("b", cached_blocks=6), state("c")]
    assert pull_source(states, "c", min_blocks=2) == "b"
    assert pull_source(states, "a", min_blocks=3) == "b"  # 6 - 3 = 3: enough
    assert pull_source(states, "a", min_blocks=4) is None  # not enough more
    assert pull_source(states, "b", min_blocks=1) is None  # nobody holds more than b
    # what a router only predicts there (not published) cannot be pulled
    assert pull_source([state("a", predicted_blocks=8), state("b")], "b", 1) is None
    assert pull_source([state("a", cached_blocks=None), state("b")], "b", 1) is None


def test_pullable_is_the_best_other_replicas_run() -> None:
    states = with_pullable([state("a", cached_blocks=3), state("b", cached_blocks=6), state("c")])
    assert {s.replica_id: s.pullable_blocks for s in states} == {"a": 6, "b": 3, "c": 6}
    assert with_pullable([state("a", cached_blocks=5)])[0].pullable_blocks == 0


def test_pulled_tokens_stop_at_the_usable_prompt_and_need_min_blocks() -> None:
    req = request(1, num_blocks=8, extra=0)  # 128 tokens: 7 blocks usable (one token runs)
    assert pulled_tokens(req, state("a", pullable_blocks=8), 2) == 7 * 16
    assert pulled_tokens(req, state("a", cached_blocks=4, pullable_blocks=8), 2) == 3 * 16
    assert pulled_tokens(req, state("a", predicted_blocks=6, pullable_blocks=8), 2) == 0
    assert pulled_tokens(req, state("a", cached_blocks=6, pullable_blocks=7), 2) == 0
    assert pull_price(PULL, 0) == 0
    assert pull_price(PULL, 112) == 20 + 6  # the call, then ceil(112 x 0.05)


def test_a_pull_is_priced_not_charged_as_a_prefill() -> None:
    req = request(2, num_blocks=8, extra=5)  # 133 tokens, 128 usable
    replicas = with_pullable([state("a", cached_blocks=8, in_flight=1), state("b")])
    plain = PrefillCost(CostKnobs(decode_cost_tokens=10))
    priced = PrefillCost(CostKnobs(decode_cost_tokens=10, pull=PULL))
    assert plain.costs(req, replicas) == {"a": 5 + 10, "b": 133}
    # b pulls 128 tokens for 20 + ceil(6.4) = 27 and computes the last 5
    assert priced.costs(req, replicas) == {"a": 5 + 10, "b": 5 + 27}


def test_with_pulls_a_busy_holder_loses_the_overflow_to_an_idle_replica_early() -> None:
    req = request(3, num_blocks=32, extra=5)  # 517 tokens
    knobs = {"decode_cost_tokens": 16, "sticky_budget_tokens": 512}
    busy = with_pullable([state("a", cached_blocks=32, prefill_tokens=400), state("b")])
    assert PrefillCost(CostKnobs(**knobs)).rank(req, busy)[0] == "a"  # recomputing is dearer
    pulling = PrefillCost(CostKnobs(**knobs, pull=PULL))
    assert pulling.rank(req, busy)[0] == "a"  # 400 + 5 vs 5 + 46: within the budget
    busier = with_pullable([state("a", cached_blocks=32, prefill_tokens=600), state("b")])
    assert pulling.rank(req, busier)[0] == "b"
    assert pulling.explain().startswith("prefill_cost spill")
    assert PrefillCost(CostKnobs(**knobs)).rank(req, busier)[0] == "a"


def test_the_core_credits_pulled_tokens_and_books_only_what_is_computed() -> None:
    req = request(4, num_blocks=8, extra=5)
    answer = ReplicaTable.of([state("a", cached_blocks=8), state("b")])
    for pulls, booked in ((None, 133), (PULL, 5)):
        core = RoutingCore(make_policy(routing_config(policy="round_robin")), pulls=pulls)
        states = core.states(["a", "b"], answer, req.block_hashes)
        decision = core.decide(req, states)
        assert core.routed(decision, "b").prefill_tokens == booked
    # without an answer there is nothing to pull from: no credit for a pull
    core = RoutingCore(make_policy(routing_config(policy="round_robin")), pulls=PULL)
    assert core.decide(req, core.states(["a", "b"], None, req.block_hashes)).credits["b"] == 0


COST = CostModel(0.008, 0.0004, 0.001, pull_call_s=0.01, pull_block_s=0.0003)


@pytest.mark.parametrize("policy", ["round_robin+pull", "prefill_cost+pull"])
def test_simulated_replicas_pull_and_the_books_still_balance(policy: str) -> None:
    trace = make_trace(WorkloadSpec("multi_tenant", num_requests=160, rate=20, tenants=6))
    name, pull = split_pull(policy)
    assert pull is not None and pull.enabled
    engine = tiny(num_blocks=256)
    sim = Simulation(sim_policy(name, pull=pull), 4, engine, COST, pull=pull)
    results, _ = sim.run(trace)
    assert all(r.completion_tokens == t.max_tokens for r, t in zip(results, trace, strict=True))
    assert sim.tally.pulls > 0 and sim.tally.pulled_blocks > 0
    for replica in sim.replicas.values():
        replica.engine.check_invariants(idle=True)
        assert replica.engine.stats().blocks_in_use == 0 and replica.pulling == 0
    oracle = oracle_hit_rate(trace, engine.block_hasher(), ByteTokenizer())
    assert sim.engine_hit_rate() <= oracle + 1e-9
    if name == "round_robin":  # it scatters each tenant: pulls turn those misses into hits
        plain = Simulation(sim_policy(name), 4, engine, COST)
        plain.run(trace)
        assert plain.engine_hit_rate() + 0.05 < sim.engine_hit_rate()


def test_the_pull_suffix_is_the_only_one() -> None:
    assert split_pull("prefill_cost") == ("prefill_cost", None)
    assert split_pull("dynamo_kv+pull", '{"min_blocks": 8}')[1] == PullConfig(
        enabled=True, min_blocks=8
    )
    with pytest.raises(ValueError):
        split_pull("prefill_cost+push")
