"""Traces: seeded, reproducible, Poisson, Zipf, growing histories, and the oracle hit rate."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from pathlib import Path

import pytest

from bench.experiments.tenants import censored_percentile
from bench.tenant_workloads import agent_sessions, tenant_trace
from bench.workloads import (
    WORKLOADS,
    TraceRequest,
    WorkloadSpec,
    load_trace,
    make_trace,
    oracle_hit_rate,
    save_trace,
)
from kvindex.hashing import BlockHasher
from replica.checkpoints.tokenizer import ByteTokenizer

HASHER = BlockHasher(16, "tiny-llama-6m")
BYTES = ByteTokenizer()


@pytest.mark.parametrize("workload", WORKLOADS)
def test_traces_are_seeded_and_reproducible(workload: str, tmp_path: Path) -> None:
    spec = WorkloadSpec(workload, num_requests=50)
    trace = make_trace(spec)
    assert trace == make_trace(spec)
    assert trace != make_trace(WorkloadSpec(workload, num_requests=50, seed=8))
    assert len({r.request_id for r in trace}) == 50
    assert all(a.arrival_s < b.arrival_s for a, b in itertools.pairwise(trace))
    save_trace(tmp_path / "t.jsonl", trace)
    assert load_trace(tmp_path / "t.jsonl") == trace


def test_arrivals_are_poisson_at_the_given_rate() -> None:
    trace = make_trace(WorkloadSpec("random", num_requests=3000, rate=5.0))
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.12)  # exponential: sd = mean


def test_multi_tenant_popularity_follows_zipf() -> None:
    trace = make_trace(WorkloadSpec("multi_tenant", num_requests=4000, tenants=50, zipf=1.1))
    counts = Counter(r.group for r in trace)
    assert len(counts) <= 50
    assert counts["tenant-0"] > counts["tenant-1"] > counts["tenant-5"] > counts["tenant-40"]
    assert counts["tenant-0"] / counts["tenant-9"] == pytest.approx(10**1.1, rel=0.35)
    flat = Counter(
        r.group for r in make_trace(WorkloadSpec("multi_tenant", 4000, tenants=4, zipf=0))
    )
    assert max(flat.values()) / min(flat.values()) < 1.2
    # every request of a tenant starts with that tenant's system prompt
    by_tenant: dict[str, list[TraceRequest]] = {}
    for r in trace:
        by_tenant.setdefault(r.group, []).append(r)
    for reqs in by_tenant.values():
        head = reqs[0].prompt.split("\n")[0]
        assert all(r.prompt.startswith(head + "\n") for r in reqs)


def test_multi_turn_resends_the_growing_history() -> None:
    spec = WorkloadSpec("multi_turn", num_requests=300, conversations=4, max_history_chars=1500)
    trace = make_trace(spec)
    last: dict[str, str] = {}
    for r in trace:
        if r.group in last:
            assert r.prompt.startswith(last[r.group])
            assert len(r.prompt) > len(last[r.group])
        last[r.group] = r.prompt
    assert len(last) > 4  # long conversations were replaced by new ones
    assert max(len(r.prompt) for r in trace) < 1500 + 400


def test_oracle_hit_rate() -> None:
    same = TraceRequest("a", 0.0, "x" * 32, 4), TraceRequest("b", 1.0, "x" * 32, 4)
    # BOS + 32 bytes = 33 tokens: the second prompt reuses (33 - 1) // 16 = 2 blocks
    assert oracle_hit_rate(same, HASHER, BYTES) == pytest.approx(32 / 66)
    assert oracle_hit_rate(make_trace(WorkloadSpec("random", 100)), HASHER, BYTES) == 0.0
    assert oracle_hit_rate(make_trace(WorkloadSpec("chat", 100)), HASHER, BYTES) > 0.8


def test_a_tenant_trace_is_cached_after_its_first_request_only_when_asked() -> None:
    """``tenant_trace``: arrivals inside the duration; cached: one system prompt shared by
    every request of the tenant (and not by another tenant's); uncached: no two requests
    share even their first few blocks."""
    hasher, tokenizer = HASHER, BYTES

    def first_blocks(trace: list[TraceRequest], k: int = 3) -> set[bytes]:
        """Each request's chain at block ``k`` (cumulative: equal means equal up to it)."""
        return {hasher.chain(r.token_ids(tokenizer))[k] for r in trace}

    cached = tenant_trace("b", 2.0, 20.0, seed=0, cached=True)
    other = tenant_trace("a", 2.0, 20.0, seed=0, cached=True)
    uncached = tenant_trace("a", 2.0, 20.0, seed=0, cached=False)
    assert all(0 < r.arrival_s < 20.0 for r in cached + uncached)
    assert 20 <= len(cached) <= 60 and {r.group for r in cached} == {"b"}
    assert len(first_blocks(cached, 50)) == 1  # ~1,200 shared characters: 75 blocks
    assert first_blocks(cached) != first_blocks(other)
    assert oracle_hit_rate(cached, hasher, tokenizer) > 0.7
    assert len(first_blocks(uncached)) == len(uncached)
    assert oracle_hit_rate(uncached, hasher, tokenizer) == 0.0
    # another phase's trace: the same system prompt, none of the same requests
    noisy = tenant_trace("b", 2.0, 20.0, seed=0, cached=True, variant="noisy")
    assert first_blocks(noisy, 50) == first_blocks(cached, 50)
    assert not {r.prompt for r in noisy} & {r.prompt for r in cached}


def test_a_percentile_beyond_the_cut_off_is_unknown_not_a_number() -> None:
    """Requests abandoned before their first token are only known to be beyond the cut-off:
    a percentile that needs one of them is None; one that does not is exact."""
    inf = math.inf
    assert censored_percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert censored_percentile([1.0, 2.0, 3.0, inf, inf], 50) == 3.0
    assert censored_percentile([1.0, 2.0, 3.0, 4.0, inf], 99) is None
    assert censored_percentile([1.0] * 99 + [inf], 50) == 1.0
    assert censored_percentile([], 50) is None


def test_agent_sessions_grow_by_a_tool_result_and_wait_for_the_tool() -> None:
    sessions = agent_sessions(3, 4, (10.0, 60.0), seed=1)
    assert sessions == agent_sessions(3, 4, (10.0, 60.0), seed=1)  # seeded
    assert len(sessions) == 3 and all(len(s) == 4 for s in sessions)
    for s in sessions:
        prompts = [turn.request.prompt for turn in s]
        for before, after in itertools.pairwise(prompts):
            assert after.startswith(before) and "Tool result:" in after[len(before) :]
        assert 0 <= s[0].wait_s <= 10 and all(10 <= t.wait_s <= 60 for t in s[1:])
    assert len({s[0].request.prompt[:40] for s in sessions}) == 3  # a system prompt each
