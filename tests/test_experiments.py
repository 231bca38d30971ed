"""The experiment commands run and print their JSON contract (tiny sizes; no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.redis_server import LocalRedis

REPO = Path(__file__).resolve().parent.parent


def run_experiment(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_benchmark_prints_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    result = run_experiment(
        "engine",
        "--trace",
        "chat",
        "--requests",
        "6",
        "--rate",
        "50",
        "--repeats",
        "1",
        "--out",
        str(out),
    )
    assert json.loads(out.read_text()) == result
    assert result["trace"] == "chat"
    keys = {
        "requests",
        "prompt_tokens",
        "cached_prompt_tokens",
        "hit_rate",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "output_tokens_per_s",
        "duration_s",
    }
    for mode in ("cache_off", "cache_on"):
        assert keys <= set(result[mode])
        assert result[mode]["requests"] == 6
    assert result["cache_off"]["hit_rate"] == 0.0
    assert result["cache_on"]["hit_rate"] > 0.5
    conditions = result["conditions"]
    assert conditions["model_parameters"] == 5_772_544  # the README's tiny model
    # hashing a whole 4,096-token prompt (once, at the ingress) costs a small part of one
    # request's time to first token; a value in the wrong unit would not fit either
    assert 0 < conditions["hash_4096_tokens_ms"] < 1e3 * result["cache_on"]["ttft_p50_s"]


def test_index_benchmark_against_a_given_redis(redis_server: LocalRedis) -> None:
    result = run_experiment(
        "index", "--redis-url", redis_server.url, "--blocks", "4000", "--queries", "50"
    )
    assert result["blocks_indexed"] == 4000
    assert len(result["answer"]) == 8
    assert sorted(result["answer"].values()) == [0, 32, 64, 96, 128, 160, 192, 224]
    # percentiles in order, and every query answered within its 1 s timeout (a slower one
    # would have failed: the benchmark checks every answer)
    assert 0 < result["query_p50_ms"] <= result["query_p99_ms"] < 1e3
    # a block costs two set members (16-byte hash, replica id) and their keys' share
    assert 16 < result["memory_bytes_per_block"] < 4096


def test_store_benchmark_restores_what_another_engine_computed() -> None:
    result = run_experiment(
        "store", "--where", "engine", "--prefix-tokens", "256", "--repeats", "2", "--store-mb", "16"
    )
    assert result["cached_tokens_min"] == {"computed": 0, "restored": 256, "local_hit": 256}
    assert result["store"]["store_restored_blocks"] == 2 * 16
    for key in ("ttft_computed_s", "ttft_restored_s", "restored_over_local_hit"):
        assert set(result[key]) == {"median", "min", "max"}
    decode = run_experiment("store", "--where", "decode", "--repeats", "2", "--requests", "4")
    assert decode["spilled_blocks"] > 0 and set(decode["decode_step_p99_s"]) == {"on", "off"}


def test_a_policys_suffix_turns_the_routers_mirror_on_or_off() -> None:
    import argparse

    from bench.experiments.routing import _index_config
    from bench.experiments.routing_args import split_mirror

    assert split_mirror("prefill_cost+pull+mirror") == ("prefill_cost+pull", True)
    assert split_mirror("prefill_cost+nomirror") == ("prefill_cost", False)
    assert split_mirror("prefill_cost") == ("prefill_cost", None)
    args = argparse.Namespace(index='{"mirror": true, "timeout_s": 0.5}')
    assert not _index_config(args, "redis://x:1/0", "ns", False).mirror  # the suffix wins
    assert _index_config(args, "redis://x:1/0", "ns", None).mirror
    assert _index_config(args, "redis://x:1/0", "ns", None).timeout_s == 0.5


def test_knobs_tune_the_policies_that_have_them_and_a_misspelt_one_fails_first() -> None:
    """``--knobs`` beside round robin: prefill_cost takes them, round robin runs as it is
    (it failed validation in its first run); a knob no policy has stops the run at once."""
    from bench.experiments.routing_args import check_knobs, our_routing

    knobs = {"decode_cost_tokens": 64}
    assert our_routing("prefill_cost", 0.25, knobs).decode_cost_tokens == 64
    assert our_routing("round_robin", 0.25, knobs) == our_routing("round_robin", 0.25, {})
    check_knobs(["round_robin", "prefill_cost+pull+mirror"], knobs)
    check_knobs(["sglang_cache_aware", "cache_aware"], {"epsilon": 0.5})  # a peer model: none
    with pytest.raises(ValueError, match="decode_cost_token"):
        check_knobs(["prefill_cost"], {"decode_cost_token": 64})
    with pytest.raises(ValueError, match="no field"):
        check_knobs(["round_robin", "sglang_cache_aware"], knobs)


def test_a_variant_runs_its_policy_with_its_own_knobs_and_a_wrong_one_fails_first() -> None:
    """``prefill_cost@fit`` beside ``prefill_cost`` in one ABBA run: the variant's knobs on
    top of ``--knobs``, the plain name without them; the drop-in (``ray_llm:ours``) takes
    ``prefill_cost``'s, any Ray Serve LLM app a deployment's ``max_ongoing_requests``; an
    unknown variant, a knob its policy lacks, or routing knobs for one of Ray's own routers
    stop the run before its first cluster."""
    import argparse

    from bench.experiments.routing_args import check_variants, run_knobs
    from bench.experiments.routing_ray_llm import check_ray_llm_policies, is_ray_llm

    args = argparse.Namespace(
        knobs='{"sticky_budget_tokens": 512}',
        variants='{"fit": {"decode_cost_tokens": 96}, "b32": {"max_ongoing_requests": 32}}',
        epsilon=0.25,
    )
    assert run_knobs(args, "prefill_cost") == ("prefill_cost", {"sticky_budget_tokens": 512})
    assert run_knobs(args, "ray_llm:ours@fit") == (
        "ray_llm:ours",
        {"sticky_budget_tokens": 512, "decode_cost_tokens": 96},
    )
    policies = ["prefill_cost", "prefill_cost+nostore@fit", "ray_llm:ours@fit", "ray_llm:kv@b32"]
    check_variants(args, policies, peer=is_ray_llm)
    check_ray_llm_policies(args, policies)
    with pytest.raises(ValueError, match="no variant 'fitt'"):
        check_variants(args, ["prefill_cost@fitt"])
    with pytest.raises(ValueError, match="no field"):
        check_variants(  # round robin has no decode cost
            argparse.Namespace(knobs=None, variants=args.variants, epsilon=0.25),
            ["round_robin@fit"],
        )
    with pytest.raises(ValueError, match="Ray's take none"):
        check_ray_llm_policies(args, ["ray_llm:kv@fit"])


def test_repeated_runs_report_one_p99_of_all_their_requests() -> None:
    from bench.report import combine

    fast = {"ttft_p99_s": 0.1, "ttft_samples": [0.1] * 99 + [0.1]}
    slow = {"ttft_p99_s": 0.2, "ttft_samples": [0.1] * 90 + [2.0] * 10}
    merged = combine([fast, slow])
    assert merged["ttft_p99_s"] == pytest.approx(
        0.15
    )  # the median of the runs' p99s hides the slow tail
    assert merged["ttft_pooled_p99_s"] == 2.0  # 10 of 200 requests took 2 s
    assert merged["ttft_pooled_p50_s"] == 0.1 and merged["runs"] == 2
    assert merged["requests_by_run"] == [[], []]


def test_speed_without_peers_reports_how_close_ours_came_to_the_machine(tmp_path: Path) -> None:
    result = run_experiment(
        "speed", "--model", "tiny-llama-6m", "--dtype", "float32", "--peers", "ours",
        "--batches", "1", "--repeats", "1", "--prefill-tokens", "64", "--decode-tokens", "8",
        "--out", str(tmp_path / "speed.json"),
    )  # fmt: skip
    machine = result["machine"]
    assert machine["path"] in {"amx", "avx512_bf16", "avx512", "avx2", "portable"}
    assert machine["prefill_of_peak"] > 0 and machine["decode_b1_of_bandwidth"] > 0
    assert machine["bandwidth_gb_s"] > 0 and machine["peak_gflops"] > 0
    assert "machine" in json.loads((tmp_path / "speed.json").read_text())


def test_speed_times_decode_inside_one_run_and_refuses_a_run_with_none() -> None:
    from conftest import tiny

    from bench.experiments.speed_peers import Timing
    from bench.peers.engine_worker import timed_generate
    from replica.model.runner import build_engine
    from replica.sampling.params import SamplingParams

    engine = build_engine(tiny(max_num_batched_tokens=16, max_num_seqs=4))  # chunked prefill
    prompts = [[1 + i + j for j in range(20)] for i in range(3)]
    timing = Timing.of(timed_generate(engine, prompts, SamplingParams(max_tokens=6)))
    assert 0 < timing.first_s < timing.total_s
    # every prompt had a token at the first moment; some may already have had more
    assert 3 <= timing.tokens_at_first < 18
    rate = timing.decode_rate(18)
    assert rate == pytest.approx((18 - timing.tokens_at_first) / (timing.total_s - timing.first_s))
    assert not engine.has_unfinished_requests() and engine.block_manager.usage().in_use == 0
    with pytest.raises(ValueError, match="no decode was timed"):
        Timing(total_s=1.0, first_s=1.0, tokens_at_first=3).decode_rate(3)


def test_tracing_pairs_each_repeats_rounds_and_judges_the_target_on_their_ratios() -> None:
    """``tracing``: the parser's defaults, one trace for every round, on / off per ABBA pair
    (mean, min-max) and the 3% verdict, and the table rendered from it (no cluster)."""
    from bench.__main__ import build_parser
    from bench.experiments import tracing
    from bench.tables import tracing_table

    args = build_parser().parse_args(["tracing"])
    defaults = (args.model, args.replicas, args.requests, args.concurrency, args.repeats)
    assert defaults == ("tiny-llama-6m", 2, 200, 8, 2)
    assert tracing.trace(args) == tracing.trace(args)
    assert len(tracing.trace(args)) == args.warmup + args.requests
    assert all(r.system for r in tracing.trace(args))  # chats under shared system prompts
    assert tracing.tracing_env("http://x:1")["OTEL_TRACES_SAMPLER_ARG"] == "1.0"

    def one(rps: float, ttft: float, spans: float) -> dict:
        return {"requests_per_s": rps, "output_tokens_per_s": 16 * rps, "ttft_p50_s": ttft,
                "ttft_p99_s": 2 * ttft, "spans_per_request": spans, "cached_fraction": 0.8,
                "failed": 0}  # fmt: skip

    runs = {
        "off": [one(10.0, 0.100, 0), one(10.0, 0.100, 0)],
        "on": [one(9.9, 0.102, 12), one(9.7, 0.101, 12)],
    }
    summary = tracing.summary(runs)
    rps = summary["on_over_off"]["requests_per_s"]
    assert (rps["min"], rps["max"]) == (0.97, 0.99) and rps["mean"] == pytest.approx(0.98)
    assert summary["target_met"] == {"requests_per_s": True, "ttft_p50_s": True}
    runs["on"][1]["ttft_p50_s"] = 0.110  # the pairs' mean ratio: 1.06
    assert not tracing.summary(runs)["target_met"]["ttft_p50_s"]
    table = tracing_table({"summary": tracing.summary(runs), "target": tracing.TARGET})
    assert "| <= 1.03: not met |" in table and "| >= 0.97: met |" in table
    assert "| spans received per request | 0.0 | 12.0 | | |" in table


def test_tails_split_each_run_at_the_head_and_find_its_slowest_request(tmp_path: Path) -> None:
    """``bench.tails`` on a run folder as ``bench routing --out`` writes it: a burst in the
    first seconds is apart from the rest, per run, and a head that leaves a part empty is
    refused."""
    from bench.tails import tails
    from bench.workloads import TraceRequest, save_trace

    arrivals = [0.1 * i for i in range(20)] + [3.0 + i for i in range(80)]
    save_trace(
        tmp_path / "trace-rate_4_s.jsonl",
        [TraceRequest(f"r{i}", at, "p", 4) for i, at in enumerate(arrivals)],
    )

    def rows(head_ttft: float) -> list[list]:  # the head's requests slow, the rest 0.5 s
        return [
            [f"r{i}", "a", 200, head_ttft if at < 3.0 else 0.5 + 0.01 * (i % 10), 10, 0]
            for i, at in enumerate(arrivals)
        ] + [["r-failed", "a", 503, None, 10, 0]]

    requests = {"rate 4/s": {"ours": [rows(2.0), rows(1.0)]}}
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    (first, second) = tails(tmp_path, 3.0)["rate 4/s"]
    assert (first.run, first.head, first.head_max_s, first.slowest_arrival_s) == (0, 20, 2.0, 0.0)
    assert second.head_max_s == 1.0
    assert first.rest_max_s == pytest.approx(0.59) and first.rest_p50_s == pytest.approx(0.545)
    with pytest.raises(ValueError, match="leaves a part empty"):
        tails(tmp_path, 100.0)
