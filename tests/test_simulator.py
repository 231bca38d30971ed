"""The simulator runs the real engine code with a cost model; checks that need no Ray."""

from __future__ import annotations

from cluster.experiments.cost_model import CostModel, calibrate
from cluster.experiments.simulate import PEERS, sim_policy
from cluster.experiments.simulator import Simulation
from cluster.experiments.workloads import WorkloadSpec, make_trace, oracle_hit_rate
from replica.config import EngineConfig
from replica.tokenizer import ByteTokenizer

COST = CostModel(base_s=0.008, prefill_token_s=0.0004, decode_seq_s=0.001)
ENGINE = EngineConfig(num_blocks=256)


def simulate(policy: str, trace, replicas: int = 4) -> Simulation:
    sim = Simulation(sim_policy(policy), replicas, ENGINE, COST)
    sim.results, sim.makespan = sim.run(trace)
    return sim


def test_every_request_completes_and_the_books_balance() -> None:
    trace = make_trace(WorkloadSpec("multi_tenant", num_requests=150, rate=20, tenants=12))
    for policy in ("round_robin", "prefix_affinity", "cache_aware", "prefill_cost", *PEERS):
        sim = simulate(policy, trace)
        done = zip(sim.results, trace, strict=True)
        assert all(r.completion_tokens == t.max_tokens for r, t in done)
        assert all(r.ttft_s is not None and r.ttft_s > 0 for r in sim.results)
        for replica in sim.replicas.values():
            replica.engine.check_invariants()
            assert replica.engine.stats().blocks_in_use == 0
        assert (
            sim.engine_hit_rate()
            <= oracle_hit_rate(trace, ENGINE.block_hasher(), ByteTokenizer()) + 1e-9
        )


def test_the_simulation_is_deterministic() -> None:
    trace = make_trace(WorkloadSpec("multi_turn", num_requests=80, rate=10))
    a, b = simulate("cache_aware", trace), simulate("cache_aware", trace)
    assert [(r.replica, r.ttft_s, r.cached_tokens) for r in a.results] == [
        (r.replica, r.ttft_s, r.cached_tokens) for r in b.results
    ]


def test_prefix_routing_beats_round_robin_when_tenants_outgrow_one_cache() -> None:
    trace = make_trace(WorkloadSpec("multi_tenant", num_requests=400, rate=8, tenants=40, zipf=0.6))
    rr = simulate("round_robin", trace, replicas=8).engine_hit_rate()
    affinity = simulate("prefix_affinity", trace, replicas=8).engine_hit_rate()
    aware = simulate("cache_aware", trace, replicas=8).engine_hit_rate()
    assert affinity > rr + 0.15 and aware > rr + 0.15


def test_no_policy_invents_savings_on_random_prompts() -> None:
    trace = make_trace(WorkloadSpec("random", num_requests=60, rate=10))
    for policy in ("round_robin", "prefix_affinity", "cache_aware", "prefill_cost", *PEERS):
        assert simulate(policy, trace).engine_hit_rate() == 0.0


def test_calibration_fits_a_positive_cost_model() -> None:
    tiny = EngineConfig(
        model={
            "num_layers": 2,
            "hidden_size": 64,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 128,
        }
    )
    cost = calibrate(tiny)
    assert cost.base_s >= 0 and cost.prefill_token_s > 0
    assert "steps" in cost.measured
