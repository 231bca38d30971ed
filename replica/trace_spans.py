"""A traced request's spans on its replica, written once it is over from what was timed on
the way (``EngineTimes``, the pull's outcome): nothing on the step's path creates a span.

``replica.generate`` (the request's whole stay, a child of the ingress's engine call through
the ``traceparent`` it carried) holds, as they happened: ``replica.pull`` (from whom, how
many tokens, failed or not), ``replica.step_wait`` (its add handed to the engine's thread
until that thread took it: whatever it was running, mostly the rest of a step),
``replica.restore`` (from the node store), ``replica.queue`` (added to first scheduled),
``replica.prefill`` with one ``replica.prefill.chunk`` per step that computed part of the
prompt, and ``replica.decode`` (first token to the last).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Tracer

from replica.messages import EngineRequest, EngineTimes, RequestOutput
from replica.telemetry import epoch_ns, parent_context

if TYPE_CHECKING:  # the puller imports the engine (torch): not where the app is built
    from replica.pull import PullOutcome


def record_replica_spans(
    tracer: Tracer,
    request: EngineRequest,
    replica_id: str,
    stay: tuple[float, float],
    pulled: PullOutcome | None,
    waited: tuple[float, float],
    last: RequestOutput | None,
    output_tokens: int,
) -> None:
    """The spans of one request's ``stay`` (monotonic start, end) on ``replica_id``;
    ``waited``: when its add was handed to the engine's thread and when that thread took
    it (``replica.step_wait``: mostly the rest of the step it was running); ``last``: its last
    output (None: it never produced one, or its stream was cut); ``output_tokens``: how
    many it streamed (choice 0)."""
    attributes = {
        "prefix_serve.replica": replica_id,
        "prefix_serve.request_id": request.request_id,
        "prefix_serve.prompt_tokens": len(request.prompt_token_ids),
        "prefix_serve.resumed_tokens": len(request.output_token_ids),
        "prefix_serve.finish_reason": (last.finish_reason or "") if last else "cancelled",
    }
    if last is not None:
        attributes |= {
            "prefix_serve.cached_tokens": last.num_cached_tokens,
            "prefix_serve.restored_tokens": last.num_restored_tokens,
        }
    attributes["prefix_serve.output_tokens"] = output_tokens
    root = tracer.start_span(
        "replica.generate",
        context=parent_context(request.trace_parent),
        kind=SpanKind.SERVER,
        start_time=epoch_ns(stay[0]),
        attributes=attributes,
    )
    inside = trace.set_span_in_context(root)
    if pulled is not None:
        _span(tracer, inside, "replica.pull", pulled.started, pulled.started + pulled.seconds,
              {"prefix_serve.pull.holder": pulled.holder,
               "prefix_serve.pull.tokens": pulled.tokens,
               "prefix_serve.pull.failed": pulled.failed})  # fmt: skip
    _span(tracer, inside, "replica.step_wait", waited[0], waited[1], {})
    if last is not None and last.times is not None:
        _engine_spans(tracer, inside, last.times, last, output_tokens)
    root.end(end_time=epoch_ns(stay[1]))


def _engine_spans(
    tracer: Tracer, inside: Context, times: EngineTimes, last: RequestOutput, output_tokens: int
) -> None:
    """Restore, queue, prefill (chunk by chunk) and decode, from the engine's times."""
    added = times.arrival + times.restore_s
    if times.restore_s > 0:
        restored = {"prefix_serve.restored_tokens": last.num_restored_tokens}
        _span(tracer, inside, "replica.restore", times.arrival, added, restored)
    if times.scheduled is not None:
        queued = {"prefix_serve.preemptions": times.preemptions}
        _span(tracer, inside, "replica.queue", added, times.scheduled, queued)
    first = times.first_token
    if times.chunks and first is not None:
        computed = sum(n for _, _, n in times.chunks)
        prefill = tracer.start_span(
            "replica.prefill",
            context=inside,
            start_time=epoch_ns(times.chunks[0][0]),
            attributes={
                "prefix_serve.computed_tokens": computed,
                "prefix_serve.cached_tokens": last.num_cached_tokens,
                "prefix_serve.chunks": len(times.chunks),
            },
        )
        in_prefill = trace.set_span_in_context(prefill)
        for start, end, n in times.chunks:
            _span(tracer, in_prefill, "replica.prefill.chunk", start, end,
                  {"prefix_serve.tokens": n})  # fmt: skip
        prefill.end(end_time=epoch_ns(first))
    if first is not None:
        decoded = {"prefix_serve.output_tokens": output_tokens}
        _span(tracer, inside, "replica.decode", first, times.finished, decoded)


def _span(
    tracer: Tracer,
    parent: Context,
    name: str,
    start: float,
    end: float,
    attributes: dict[str, str | int | bool],
) -> None:
    at = epoch_ns(start)
    span = tracer.start_span(name, context=parent, start_time=at, attributes=attributes)
    span.end(end_time=epoch_ns(max(start, end)))
