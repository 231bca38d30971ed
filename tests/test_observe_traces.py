"""Traces and the reuse ledger on a real cluster (``tests/observed.py``: two replicas, round
robin, pulls of 8 blocks or more, every process exporting to an OTLP/HTTP receiver whose
protobuf the test decodes with OpenTelemetry's proto package).

- one request is one trace: the ingress's spans, the router's decision and the replica's
  spans, each under the right parent, in one trace id, continuing a client's
  ``traceparent`` and answering with ours;
- the ledger's three numbers on constructed cases: a short prefix cached on the other
  replica under round robin (reusable > routed = delivered), a long one pulled from it
  (delivered > routed), and the replica that holds it (all three equal);
- a replica killed mid-stream: one trace holds both replicas' sends;
- a streamed request's TTFT cut into parts from its trace (``bench.harness.span_breakdown``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid

import httpx
import pytest
from observed import KEY, MODEL, PULL_MIN_BLOCKS, Observed

from bench.harness.otlp_receiver import ReceivedSpan
from bench.harness.span_breakdown import PARTS, breakdown
from bench.loadgen import RequestResult, new_traceparent, send
from bench.workloads import TraceRequest

HEADERS = {"authorization": f"Bearer {KEY}"}
BLOCK = 16


def chat(
    observed: Observed, system: str, question: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0.0,
    }
    url = f"{observed.base_url}/v1/chat/completions"
    reply = httpx.post(url, json=body, headers=HEADERS | (headers or {}), timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def reuse(reply: httpx.Response) -> dict[str, int]:
    fields = dict(part.strip().split("=") for part in reply.headers["x-prefix-reuse"].split(";"))
    return {k: int(v) for k, v in fields.items()}


def trace_of(observed: Observed, reply: httpx.Response, names: set[str]) -> list[ReceivedSpan]:
    """The spans of the reply's trace, once every one of ``names`` has arrived."""
    return trace_of_id(observed, reply.headers["traceparent"].split("-")[1], names)


def trace_of_id(observed: Observed, trace_id: str, names: set[str]) -> list[ReceivedSpan]:
    deadline = time.monotonic() + 15
    while True:
        spans = observed.receiver.spans(trace_id)
        if names <= {s.name for s in spans}:
            return spans
        assert time.monotonic() < deadline, sorted(s.name for s in spans)
        time.sleep(0.1)


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


SPANS = {
    "POST /v1/chat/completions",
    "ingress.parse",
    "ingress.tokenize",
    "ingress.admission",
    "ingress.engine_call",
    "router.decide",
    "replica.generate",
    "replica.step_wait",
    "replica.queue",
    "replica.prefill",
    "replica.prefill.chunk",
    "replica.decode",
}


def test_a_request_is_one_trace_with_every_hop_under_its_parent(observed: Observed) -> None:
    client_trace, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    parent = f"00-{client_trace}-{client_span}-01"
    reply = chat(
        observed, f"Trace {uuid.uuid4().hex}. " * 8, "Hi?", headers={"traceparent": parent}
    )
    assert reply.headers["traceparent"].split("-")[1] == client_trace  # continued
    spans = trace_of(observed, reply, SPANS)
    root = one(spans, "POST /v1/chat/completions")
    assert root.parent_id == client_span and root.service == "prefix-serve-ingress"
    assert reply.headers["traceparent"].split("-")[2] == root.span_id  # ours, answered
    call = one(spans, "ingress.engine_call")
    generate = one(spans, "replica.generate")
    prefill = one(spans, "replica.prefill")
    parents = {
        "ingress.parse": root,
        "ingress.tokenize": root,
        "ingress.admission": root,
        "ingress.engine_call": root,
        "router.decide": call,
        "replica.generate": call,
        "replica.step_wait": generate,
        "replica.queue": generate,
        "replica.prefill": generate,
        "replica.decode": generate,
    }
    for name, expected in parents.items():
        assert one(spans, name).parent_id == expected.span_id, name
    chunks = [s for s in spans if s.name == "replica.prefill.chunk"]
    assert chunks and all(c.parent_id == prefill.span_id for c in chunks)
    assert generate.service == "prefix-serve-replica"
    assert generate.attributes["prefix_serve.replica"] == reply.headers["x-replica-id"]
    decide = one(spans, "router.decide")
    assert decide.attributes["prefix_serve.routing.policy"] == "round_robin"
    assert decide.attributes["prefix_serve.routing.replica"] == reply.headers["x-replica-id"]
    ledger = reuse(reply)
    assert root.attributes["prefix_serve.reuse.delivered"] == ledger["delivered"]
    assert root.attributes["prefix_serve.reuse.reusable"] == ledger["reusable"]
    for span in spans:  # every hop inside the request's time (one machine: one clock)
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns + 1_000_000, span


def test_a_trace_without_a_client_parent_starts_one(observed: Observed) -> None:
    reply = chat(observed, "A new trace. " * 4, "Hi?")
    spans = trace_of(observed, reply, {"POST /v1/chat/completions", "replica.generate"})
    assert one(spans, "POST /v1/chat/completions").parent_id == ""


def prefix_on_one_replica(observed: Observed, blocks: int) -> tuple[str, str]:
    """A system prompt of about ``blocks`` blocks, computed on one replica (returned),
    published in the index by the time this returns."""
    system = (f"Ledger {uuid.uuid4().hex}. " + "Storms by date and damage. " * 40)[: blocks * BLOCK]
    first = chat(observed, system, "Which came first?")
    assert reuse(first)["delivered"] <= BLOCK  # computed (its template's head aside)
    time.sleep(1.0)  # the replica's publisher puts its blocks in the index
    return system, first.headers["x-replica-id"]


def on_other_replica(observed: Observed, system: str, holder: str) -> httpx.Response:
    """The prompt again, on the replica that does not hold it (round robin: the next
    request goes there, unless another request came between)."""
    for _ in range(3):
        reply = chat(observed, system, "Which did the most damage?")
        if reply.headers["x-replica-id"] != holder:
            return reply
    raise AssertionError("round robin sent three requests in a row to one replica")


def test_round_robin_misses_a_short_prefix_held_elsewhere(observed: Observed) -> None:
    system, holder = prefix_on_one_replica(observed, PULL_MIN_BLOCKS - 3)
    ledger = reuse(on_other_replica(observed, system, holder))
    assert ledger["reusable"] >= (PULL_MIN_BLOCKS - 4) * BLOCK  # cached on the holder
    assert ledger["routed"] == ledger["delivered"] < ledger["reusable"]  # no pull below 8


def test_a_pull_delivers_more_than_was_routed(observed: Observed) -> None:
    system, holder = prefix_on_one_replica(observed, PULL_MIN_BLOCKS + 12)
    reply = on_other_replica(observed, system, holder)
    ledger = reuse(reply)
    assert ledger["routed"] <= BLOCK  # the replica held none of it but the template's head
    assert ledger["delivered"] > ledger["routed"] + PULL_MIN_BLOCKS * BLOCK  # pulled
    assert ledger["delivered"] <= ledger["reusable"]
    url = f"{observed.base_url}/cluster/decisions?limit=20"
    decisions = httpx.get(url, headers=HEADERS, timeout=10).json()["decisions"]
    ids = [d["request_id"] for d in decisions]
    ours = reply.headers["x-request-id"].split(",")[0]  # (Serve adds one of its own after)
    entry = decisions[ids.index(ours)]
    assert entry["pulled"] > PULL_MIN_BLOCKS * BLOCK and entry["replica"] != holder
    spans = trace_of(observed, reply, {"replica.pull", "replica.generate"})
    pull = one(spans, "replica.pull")
    assert pull.attributes["prefix_serve.pull.holder"] == holder
    assert pull.attributes["prefix_serve.pull.tokens"] == entry["pulled"]
    # and the replica that holds it now: all three numbers equal
    again = reuse(chat(observed, system, "And the least?"))
    assert again["reusable"] == again["routed"] == again["delivered"] > 0


def test_a_failover_is_one_trace_across_both_replicas(observed: Observed) -> None:
    pids = {rid: r["pid"] for rid, r in observed.cluster.stats()["replicas"].items()}
    assert len(pids) == 2
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Failover {uuid.uuid4().hex}"}],
        "max_tokens": 400,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    seen: dict[str, object] = {"pieces": 0}

    def read() -> None:
        url = f"{observed.base_url}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=120) as resp:
            seen["headers"] = resp.headers
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    seen["error"] = chunk.get("error") or seen.get("error")
                    seen["pieces"] = int(seen["pieces"]) + 1  # type: ignore[call-overload]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while int(seen["pieces"]) < 10:  # type: ignore[call-overload]
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.01)
    headers = seen["headers"]
    victim = headers["x-replica-id"]  # type: ignore[index]
    os.kill(pids[victim], signal.SIGKILL)
    reader.join(120)
    assert not reader.is_alive() and seen.get("error") is None
    trace_id = headers["traceparent"].split("-")[1]  # type: ignore[index]
    deadline = time.monotonic() + 15
    while True:
        calls = [s for s in observed.receiver.spans(trace_id) if s.name == "ingress.engine_call"]
        if len(calls) == 2:
            break
        assert time.monotonic() < deadline, calls
        time.sleep(0.1)
    replicas = {
        c.attributes["prefix_serve.attempt"]: c.attributes["prefix_serve.replica"] for c in calls
    }
    assert replicas[0] == victim and replicas[1] != victim
    # the survivor's own span, exported by its process once the request was over
    while not any(
        s.name == "replica.generate" and s.attributes["prefix_serve.replica"] == replicas[1]
        for s in observed.receiver.spans(trace_id)
    ):
        assert time.monotonic() < deadline, [s.name for s in observed.receiver.spans(trace_id)]
        time.sleep(0.1)


def test_a_requests_time_to_first_token_is_cut_into_parts_that_add_up(observed: Observed) -> None:
    """``bench.harness.span_breakdown`` on a real streamed request: every part of its TTFT
    as its client timed it comes from its trace, none negative, and they add up."""
    req = TraceRequest("breakdown", 0.0, "Hi?", 4, system=f"Parts {uuid.uuid4().hex}. " * 8)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(base_url=observed.base_url, headers=HEADERS) as client:
            return await send(client, MODEL, req, headers={"traceparent": new_traceparent()})

    result = asyncio.run(go())
    assert result.status == 200 and result.ttft_s is not None and result.trace_id
    names = {"POST /v1/chat/completions", "router.decide", "replica.generate", "replica.decode"}
    trace_of_id(observed, result.trace_id, names)
    found = breakdown(observed.receiver.spans(), [result])
    assert found["requests"] == 1 and found["missing_spans"] == 0, found
    parts = found["slowest"]
    assert set(parts) == {"ttft_s", *PARTS}
    assert all(parts[p] >= 0 for p in PARTS), parts
    assert sum(parts[p] for p in PARTS) == pytest.approx(result.ttft_s, abs=1e-6)
    assert parts["prefill"] > 0  # its prompt was computed: a step ran for it
