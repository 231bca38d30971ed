"""``scheduling``: what chunked prefill and the admission reserve do, on one engine.

* ``stall``: 8 streams are decoding when a ``--long-tokens`` prompt arrives. Their
  inter-token latency while it is prefilled, against their ITL p50 over the whole run, per
  token budget, and with chunking off (the whole prompt in one step: the stall).
* ``overload``: a trace offered at ``--overload`` x the engine's sustainable rate (its
  throughput with every request queued at once), with a small KV pool: preemptions,
  throughput and TTFT of the scheduler (chunked prefill, decode reserve) against the one
  before it (``legacy``: whole prompts, admission until memory runs out).
* ``priority``: a backlog of ``--backlog`` long uncached prompts (priority 0) keeps the
  engine's prefill budget busy while a short priority-5 request arrives every
  ``--urgent-every`` steps: its TTFT (from being added to its first token) and the
  backlog's output rate, with ``priority_prefill`` on and off, ABBA over ``--repeats``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

from bench.assistant_prompts import (
    LONG_DOCUMENT,
    SUPPORT_QUESTIONS,
    SUPPORT_SYSTEM_PROMPT,
)
from bench.experiments.engine import TimedRequest, replay
from bench.peers.host import provenance
from bench.workloads import TraceRequest, WorkloadSpec, make_trace
from kvindex.measure import percentile
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.checkpoints.tokenizer import Tokenizer
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.messages import Owner
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams

MODES = {
    "scheduler": {"enable_chunked_prefill": True, "decode_reserve": True},
    "legacy": {"enable_chunked_prefill": False, "decode_reserve": False},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budgets", default="128,256,512", help="max_num_batched_tokens")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--traces", default="assistant,multi_tenant")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--overload", type=float, default=1.5, help="x sustainable rate")
    parser.add_argument("--num-blocks", type=int, default=192, help="KV pool for overload")
    parser.add_argument("--backlog", type=int, default=12, help="priority: long prompts")
    parser.add_argument("--urgent", type=int, default=10, help="priority: urgent requests")
    parser.add_argument("--urgent-every", type=int, default=6, help="priority: steps apart")
    parser.add_argument("--repeats", type=int, default=2, help="priority: ABBA rounds")
    parser.add_argument("--parts", default="stall,overload")


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads)
    tokenizer = checkpoint_for(base.model).tokenizer()
    runner = ModelRunner(base.model_copy(update={"num_blocks": 4096}))
    result: dict[str, Any] = {
        "model": base.model_id,
        "dtype": str(runner.kv_cache.dtype).removeprefix("torch."),
        "provenance": provenance(),  # the commit and CPU (read before the runs)
    }
    if "stall" in args.parts:
        result["stall"] = {
            f"budget {b}" + ("" if chunked else ", chunking off"): stall(
                args, base, runner, tokenizer, b, chunked
            )
            for b, chunked in [(int(b), True) for b in args.budgets.split(",")] + [(512, False)]
        }
    if "overload" in args.parts:
        result["overload"] = {
            trace: overload(args, base, runner, tokenizer, trace)
            for trace in args.traces.split(",")
        }
    if "priority" in args.parts:
        result["priority"] = priority(args, base, runner, tokenizer)
    return result


def priority(
    args: argparse.Namespace, base: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer
) -> dict[str, Any]:
    """Urgent short requests against a backlog of long prompts (module doc), per mode."""
    document = tokenizer.encode(LONG_DOCUMENT * 100)  # 154 tokens a copy
    backlog = [document[i * 997 : i * 997 + 1000] for i in range(args.backlog)]
    urgent = [
        TraceRequest(f"u{i}", 0, SUPPORT_QUESTIONS[i % len(SUPPORT_QUESTIONS)], 0).token_ids(
            tokenizer
        )
        for i in range(args.urgent)
    ]
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for rep in range(args.repeats):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            config = base.model_copy(update={"num_blocks": 4096, "priority_prefill": mode == "on"})
            engine = Engine(config, runner=runner)
            runs[mode].append(_urgent_run(engine, backlog, urgent, args.urgent_every))
    return {
        mode: {
            "urgent_ttft_p50_s": statistics.median(r["urgent_ttft_p50_s"] for r in mode_runs),
            "urgent_ttft_p99_s": statistics.median(r["urgent_ttft_p99_s"] for r in mode_runs),
            "urgent_ttft_p99_range_s": [
                min(r["urgent_ttft_p99_s"] for r in mode_runs),
                max(r["urgent_ttft_p99_s"] for r in mode_runs),
            ],
            "backlog_output_tokens_per_s": statistics.median(
                r["backlog_output_tokens_per_s"] for r in mode_runs
            ),
            "runs": mode_runs,
        }
        for mode, mode_runs in runs.items()
    }


def _urgent_run(
    engine: Engine, backlog: list[list[int]], urgent: list[list[int]], every: int
) -> dict[str, Any]:
    engine.generate([[1] * 32], SamplingParams(max_tokens=2))  # warm up
    for i, ids in enumerate(backlog):
        engine.add_request(f"b{i}", ids, SamplingParams(max_tokens=32, ignore_eos=True))
    added: dict[str, float] = {}
    ttft: list[float] = []
    steps, start, backlog_tokens = 0, time.monotonic(), 0
    while engine.has_unfinished_requests() or len(added) < len(urgent):
        if steps % every == 0 and len(added) < len(urgent):
            rid = f"u{len(added)}"
            engine.add_request(
                rid,
                urgent[len(added)],
                SamplingParams(max_tokens=4, ignore_eos=True),
                owner=Owner("urgent", priority=5),
            )
            added[rid] = time.monotonic()
        for out in engine.step():
            if out.request_id in added and len(out.token_ids) == len(out.new_token_ids):
                ttft.append(time.monotonic() - added[out.request_id])
            elif out.finished and out.request_id.startswith("b"):
                backlog_tokens += len(out.token_ids)
        steps += 1
    return {
        "urgent_ttft_p50_s": percentile(ttft, 50),
        "urgent_ttft_p99_s": percentile(ttft, 99),
        "backlog_output_tokens_per_s": backlog_tokens / (time.monotonic() - start),
    }


def stall(
    args: argparse.Namespace,
    base: EngineConfig,
    runner: ModelRunner,
    tokenizer: Tokenizer,
    budget: int,
    chunked: bool,
) -> dict[str, Any]:
    """ITL of the running streams while a long prompt arrives (module doc)."""
    config = base.model_copy(
        update={
            "max_num_batched_tokens": budget,
            "enable_chunked_prefill": chunked,
            "num_blocks": 4096,
        }
    )
    engine = Engine(config, runner=runner)
    engine.generate([[1] * 64], SamplingParams(max_tokens=2))  # warm up
    chats = [
        TraceRequest(f"s{i}", 0, SUPPORT_QUESTIONS[i], 0, system=SUPPORT_SYSTEM_PROMPT).token_ids(
            tokenizer
        )
        for i in range(args.streams)
    ]
    for i, ids in enumerate(chats):
        engine.add_request(f"s{i}", ids, SamplingParams(max_tokens=160, ignore_eos=True))
    stamps: dict[str, list[float]] = {f"s{i}": [] for i in range(args.streams)}
    long_ids = tokenizer.encode(LONG_DOCUMENT * 20)[: args.long_tokens]
    arrived = first = None
    while engine.has_unfinished_requests():
        if arrived is None and min(len(t) for t in stamps.values()) >= 16:
            engine.add_request("long", long_ids, SamplingParams(max_tokens=8, ignore_eos=True))
            arrived = time.monotonic()
        for out in engine.step():
            now = time.monotonic()
            if out.request_id == "long":
                first = first or now
            else:
                stamps[out.request_id].append(now)
    gaps = [(t1, t1 - t0) for times in stamps.values() for t0, t1 in itertools.pairwise(times)]
    assert arrived is not None and first is not None
    window = [g for t, g in gaps if arrived < t <= first + 0.5]
    p50 = percentile([g for _, g in gaps], 50)
    return {
        "itl_p50_s": p50,
        "itl_p99_during_prefill_s": percentile(window, 99),
        "itl_max_during_prefill_s": max(window, default=None),
        "p99_over_p50": (percentile(window, 99) or 0) / p50 if p50 else None,
        "long_prompt_ttft_s": first - arrived,
        "long_prompt_tokens": len(long_ids),
    }


def overload(
    args: argparse.Namespace,
    base: EngineConfig,
    runner: ModelRunner,
    tokenizer: Tokenizer,
    trace: str,
) -> dict[str, Any]:
    """Both schedulers on the same trace at ``--overload`` x the sustainable rate."""
    spec = WorkloadSpec(
        trace, num_requests=args.requests, rate=1.0, seed=5, tenants=24, zipf=0.6, system_chars=2400
    )
    requests = [
        TimedRequest(r.request_id, r.arrival_s, r.token_ids(tokenizer), r.max_tokens)
        for r in make_trace(spec)
    ]
    config = base.model_copy(update={"num_blocks": args.num_blocks})
    burst = [TimedRequest(r.request_id, 0.0, r.token_ids, r.max_tokens) for r in requests]
    capacity = _run(Engine(config, runner=runner), burst)["requests_per_s"]
    rate = args.overload * capacity
    offered = [
        TimedRequest(r.request_id, r.arrival_s / rate, r.token_ids, r.max_tokens) for r in requests
    ]  # the trace's arrivals are at 1/s: stretched to the offered rate
    out: dict[str, Any] = {"sustainable_per_s": capacity, "offered_per_s": rate}
    for name, switches in MODES.items():
        out[name] = _run(Engine(config.model_copy(update=switches), runner=runner), offered)
    return out


def _run(engine: Engine, requests: list[TimedRequest]) -> dict[str, Any]:
    engine.generate([[1] * 32], SamplingParams(max_tokens=2))  # warm up
    engine.metrics.ttft_s.clear()
    start = time.monotonic()
    run = replay(engine, requests)
    m = engine.metrics
    return {
        "requests": len(requests),
        "preemptions": m.preemptions,
        "preemptions_per_request": m.preemptions / len(requests),
        "requests_per_s": len(requests) / (time.monotonic() - start),
        "output_tokens_per_s": m.generation_tokens / run.duration_s,
        "ttft_p50_s": percentile(m.ttft_s, 50),
        "ttft_p99_s": percentile(m.ttft_s, 99),
        "hit_rate": m.hit_rate,
    }
