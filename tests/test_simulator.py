"""The simulator runs the real engine code with a cost model; checks that need no Ray."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny

from bench.__main__ import run as run_bench
from bench.experiments.seeds import parse_seeds
from bench.experiments.simulate import PEERS, sim_policy
from bench.sim import cost_model
from bench.sim.cost_model import Clock, CostModel, calibrate
from bench.sim.simulator import Simulation
from bench.workloads import WorkloadSpec, make_trace, oracle_hit_rate
from replica.checkpoints.tokenizer import ByteTokenizer
from replica.config import EngineConfig
from replica.engine.step import ScheduledBatch

COST = CostModel(base_s=0.008, prefill_token_s=0.0004, decode_seq_s=0.001)
ENGINE = tiny(num_blocks=256)


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
    """Random prompts share no full block (the oracle says 0), and no policy reports a hit.
    The control sends each prompt again 0.5 s later: then the same engines and counters do
    report hits, up to the oracle, so the zero above is no counter stuck at 0."""
    trace = make_trace(WorkloadSpec("random", num_requests=60, rate=10))
    hasher, tokenizer = ENGINE.block_hasher(), ByteTokenizer()
    assert oracle_hit_rate(trace, hasher, tokenizer) == 0.0
    for policy in ("round_robin", "prefix_affinity", "cache_aware", "prefill_cost", *PEERS):
        assert simulate(policy, trace).engine_hit_rate() == 0.0
    again = [
        dataclasses.replace(r, request_id=f"{r.request_id}-again", arrival_s=r.arrival_s + 0.5)
        for r in trace
    ]
    repeated = sorted(trace + again, key=lambda r: r.arrival_s)
    oracle = oracle_hit_rate(repeated, hasher, tokenizer)
    assert 0.4 < oracle < 0.5  # every second prompt is cached but its last partial block
    for policy in ("prefix_affinity", "cache_aware", "prefill_cost"):
        assert 0.0 < simulate(policy, repeated).engine_hit_rate() <= oracle + 1e-9


def test_calibration_fits_a_positive_cost_model() -> None:
    small = EngineConfig(
        dtype="float32",
        model={
            "num_layers": 2,
            "hidden_size": 64,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 128,
        },
    )
    cost = calibrate(small)
    assert cost.prefill_token_s > 0
    assert "steps" in cost.measured


def test_calibration_recovers_a_known_step_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fit itself: where every step of the model takes exactly ``base + P x prefill
    tokens + D x decodes`` (on a fake clock), ``calibrate`` must give those three numbers
    back, each in its own place. Checks with the real model can only ask for positive
    costs, since its step times are noisy."""
    truth = CostModel(base_s=0.004, prefill_token_s=0.00025, decode_seq_s=0.0015)
    clock = Clock()

    class ExactModel:
        def __init__(self, config: EngineConfig) -> None:
            self.vocab = config.shape.vocab_size

        def execute(self, batch: ScheduledBatch) -> torch.Tensor:
            clock.now += truth.step_time(batch)
            return torch.zeros(sum(batch.logit_rows), self.vocab)

    monkeypatch.setattr(cost_model, "ModelRunner", ExactModel)
    monkeypatch.setattr(
        cost_model, "time", SimpleNamespace(perf_counter=clock, strftime=time.strftime)
    )
    fitted = calibrate(tiny())
    assert fitted.base_s == pytest.approx(truth.base_s, rel=1e-6)
    assert fitted.prefill_token_s == pytest.approx(truth.prefill_token_s, rel=1e-6)
    assert fitted.decode_seq_s == pytest.approx(truth.decode_seq_s, rel=1e-6)


def test_a_run_over_seeds_is_the_runs_of_each_seed(tmp_path: Path) -> None:
    """``simulate --seeds``: each seed's hit rate is what a run with ``--seed`` alone gives,
    the means are the means of those runs, and the table's median and spread are theirs."""
    common = ["--replicas", "2", "--requests", "12", "--policies", "round_robin,prefill_cost"]
    common += ["--tenants", "4", "--rates", "8"]
    over = run_bench(["simulate", "--seeds", "3-4", "--out", str(tmp_path / "both"), *common])
    alone = [
        run_bench(["simulate", "--seed", s, "--out", str(tmp_path / s), *common])
        for s in ("3", "4")
    ]
    section = "2 replicas, rate 8/s"
    for policy in ("round_robin", "prefill_cost"):
        m = over["runs"][section][policy]
        hits = [a["runs"][section][policy]["hit_rate_usage"] for a in alone]
        p99s = [a["runs"][section][policy]["ttft_p99_s"] for a in alone]
        assert m["hit_rate_by_seed"] == {"3": hits[0], "4": hits[1]}
        assert m["seed_means"]["hit_rate_usage"] == pytest.approx(sum(hits) / 2)
        assert m["seed_means"]["ttft_p99_s"] == pytest.approx(sum(p99s) / 2)
        assert m["runs"] == 2 and m["spread"]["ttft_p99_s"] == [min(p99s), max(p99s)]
    assert over["runs"][section]["prefill_cost"]["hit_rate_usage"] > 0
    oracles = [a["oracle"][section] for a in alone]
    assert over["oracle"][section] == pytest.approx(sum(oracles) / 2)


def test_seeds_are_ranges_or_lists_each_once_and_never_with_a_trace_file(
    tmp_path: Path,
) -> None:
    assert parse_seeds("1-3,7") == [1, 2, 3, 7]
    with pytest.raises(ValueError):
        parse_seeds("1-3,2")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("")
    with pytest.raises(ValueError, match="trace"):
        run_bench(["simulate", "--seeds", "1-2", "--trace", str(trace), "--out", str(tmp_path)])
