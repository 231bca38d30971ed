"""Where a traced request's time to first token went, from its spans (``cluster.tracing``,
``replica.trace_spans``) and its client's own timing.

A request's TTFT as its client saw it is cut into consecutive parts, each from the spans of
its one trace (the processes share the host's clock, so their epoch times compare):

- ``admission``: the ingress's wait for an engine slot (fair queue, quotas) with the body
  read and the prompt tokenized before it (arrival at the ingress to the first send);
- ``route``: the router's decision (``router.decide``);
- ``to_replica``: from the decision's end to the replica taking the request (Serve's
  handle, the replica's event loop);
- ``pull_check``: on the replica, from its handler taking the request to handing it to
  the engine's thread (its grammar, the index asked whether a pull would pay, a pull);
- ``step_wait``: until the engine's thread took it (``replica.step_wait``: mostly the rest
  of the step already running when it came, which is not interrupted);
- ``engine_queue``: a restore from the node store, then the engine's queue until a step
  schedules it (its priority or the batch's room may hold it there);
- ``prefill``: scheduled to its first token (the steps computing its prompt);
- ``outside``: the rest of the client's TTFT: the client to the ingress before, and the
  first token back from the replica through the ingress and Serve's proxy after.

A request whose spans are missing (not sampled, exported late, or it never reached a
replica) is counted as such, not guessed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

from bench.harness.otlp_receiver import ReceivedSpan, ReceiverProcess, tracing_env
from bench.loadgen import RequestResult
from kvindex.measure import percentile

PARTS = (
    "admission",
    "route",
    "to_replica",
    "pull_check",
    "step_wait",
    "engine_queue",
    "prefill",
    "outside",
)
ROOT_PREFIX = "POST /v1/"


def _by_trace(spans: Iterable[ReceivedSpan]) -> dict[str, dict[str, list[ReceivedSpan]]]:
    traces: dict[str, dict[str, list[ReceivedSpan]]] = defaultdict(lambda: defaultdict(list))
    for span in spans:
        name = "root" if span.name.startswith(ROOT_PREFIX) else span.name
        traces[span.trace_id][name].append(span)
    return traces


def request_parts(named: dict[str, list[ReceivedSpan]], ttft_s: float) -> dict[str, float] | None:
    """One request's parts in seconds (they add up to ``ttft_s``), or None without the spans
    that bound them. The last send counts (a resume after a replica died is a second)."""
    needed = (
        "root",
        "ingress.engine_call",
        "router.decide",
        "replica.generate",
        "replica.step_wait",
        "replica.decode",
    )
    if any(not named.get(name) for name in needed):
        return None
    root = named["root"][0]
    call = max(named["ingress.engine_call"], key=lambda s: s.start_ns)
    decide = max(named["router.decide"], key=lambda s: s.start_ns)
    stay = max(named["replica.generate"], key=lambda s: s.start_ns)
    first = max(named["replica.decode"], key=lambda s: s.start_ns).start_ns
    waited = max(named["replica.step_wait"], key=lambda s: s.start_ns)
    prefill = named.get("replica.prefill") or named.get("replica.queue") or []
    scheduled = prefill[-1].start_ns if prefill else first
    routed = max(decide.end_ns, call.start_ns)  # a decision made before the send counts 0
    marks = [root.start_ns, call.start_ns, routed, stay.start_ns]
    marks += [waited.start_ns, waited.end_ns, scheduled, first]
    gaps = [b - a for a, b in pairwise(marks)]
    parts = dict(zip(PARTS[:-1], gaps, strict=True))  # "outside": from the client's TTFT
    seconds = {k: v / 1e9 for k, v in parts.items()}
    seconds["outside"] = ttft_s - (first - root.start_ns) / 1e9
    return seconds


def breakdown(spans: Sequence[ReceivedSpan], results: Sequence[RequestResult]) -> dict[str, Any]:
    """The parts of every traced, answered request in ``results``: each part's p50 and
    max, and the parts of the slowest request (the one a tail percentile reads)."""
    traces = _by_trace(spans)
    rows: list[tuple[float, dict[str, float]]] = []
    missing = 0
    for r in results:
        if r.trace_id is None or r.ttft_s is None or r.status != 200:
            continue
        parts = request_parts(traces.get(r.trace_id, {}), r.ttft_s)
        if parts is None:
            missing += 1
        else:
            rows.append((r.ttft_s, parts))
    if not rows:
        return {"requests": 0, "missing_spans": missing}
    rows.sort(key=lambda row: row[0])
    return {
        "requests": len(rows),
        "missing_spans": missing,
        "p50_s": {p: percentile((r[p] for _, r in rows), 50) for p in PARTS},
        "max_s": {p: max(r[p] for _, r in rows) for p in PARTS},
        "slowest": {"ttft_s": rows[-1][0]} | rows[-1][1],
        "slowest_three": [{"ttft_s": t} | parts for t, parts in rows[-3:]],
    }


class TracedTenants:
    """A benchmark's tenants whose requests are traced, and the collector their spans go to:
    the cluster runs with ``env`` (sampling ratio 0: only a request whose client asks, with
    a sampled ``traceparent``, is traced, so the untraced tenants cost nothing)."""

    def __init__(self, tenants: frozenset[str]) -> None:
        self.tenants = tenants
        self.receiver = ReceiverProcess()
        self.env = tracing_env(self.receiver.endpoint, 0.0, delay_ms=500)

    def collect(self, per_tenant: Mapping[str, Sequence[RequestResult]]) -> dict[str, Any]:
        """Each traced tenant's breakdown of the phase just run; the spans are then cleared."""
        self.receiver.settled(quiet_s=3.0)
        spans = self.receiver.spans()
        self.receiver.clear()
        return {t: breakdown(spans, rs) for t, rs in per_tenant.items() if t in self.tenants}

    def stop(self) -> None:
        self.receiver.stop()
