"""The ingress's spans of a request (``replica.telemetry`` sets tracing up; off unless the
``OTEL_*`` variables configure it, and then every call here is one ``None`` check).

One trace per request, continuing the client's W3C ``traceparent`` when it sends one and
answering with ours (the server span's) in the response's ``traceparent`` header:

- ``POST /v1/...`` (server span, from the request's arrival to the last byte of its
  answer, streamed or not), with the tenant, priority, and the reuse ledger's numbers;
- ``ingress.parse`` (arrival to the handler: the body read and validated),
  ``ingress.tokenize``, ``ingress.admission`` (the wait for an engine slot);
- one ``ingress.engine_call`` per send of each prompt (a client span: a resume after a
  replica died is a second one, on another replica), holding ``router.decide`` (the
  policy, candidates, chosen replica, predicted cached tokens and each candidate's cost, as
  the router noted them) and, in the replica's process, ``replica.generate`` and its parts
  (``replica.trace_spans``), joined by the ``traceparent`` the engine request carries.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from fastapi import FastAPI, Request, Response
from opentelemetry import context, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from replica import telemetry
from router.routing_stats import RouteNote

SERVICE = "prefix-serve-ingress"
TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def tracer() -> Tracer | None:
    return telemetry.tracer(SERVICE)


def fastapi_options() -> dict[str, object]:
    """``FastAPI()``'s telemetry options where FastAPI has them (0.16x: it makes the server
    span itself, from the global provider ``replica.telemetry`` sets): its server span for
    the API paths only (a scraped ``/metrics`` is no trace), without its per-operation
    spans (``ingress.parse`` says what they would). Older FastAPI (the vLLM virtualenv's):
    none, and ``trace_requests`` makes the server span."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    telemetry_config = {
        "operation_spans": False,
        "metrics": False,
        "logs": False,
        "exclude": lambda scope: scope.get("path") not in TRACED_PATHS,
    }
    return {"telemetry": telemetry_config}


async def trace_requests(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """Middleware: the server span of an API request (FastAPI's own where it makes one,
    else ours, current while the request is handled and ended after its last byte), and
    its ``traceparent`` on the response."""
    t = tracer()
    if t is None or request.url.path not in TRACED_PATHS:
        return await call_next(request)
    current = trace.get_current_span()
    if current.is_recording():  # FastAPI's: it ends it when the answer is sent
        response = await call_next(request)
        _answer_traceparent(current, response)
        return response
    span = t.start_span(
        f"{request.method} {request.url.path}",
        context=telemetry.parent_context(request.headers.get("traceparent")),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "url.path": request.url.path},
    )
    token = context.attach(trace.set_span_in_context(span))
    try:
        response = await call_next(request)
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR))
        span.end()
        raise
    finally:
        context.detach(token)
    span.set_attribute("http.response.status_code", response.status_code)
    if response.status_code >= 500:
        span.set_status(Status(StatusCode.ERROR))
    _answer_traceparent(span, response)
    body = getattr(response, "body_iterator", None)
    if body is None:
        span.end()
    else:  # the span lasts until the answer's last byte (a stream's last token)
        response.body_iterator = _ending(body, span)  # type: ignore[attr-defined]
    return response


def _answer_traceparent(span: Span, response: Response) -> None:
    parent = telemetry.traceparent(span)
    if parent is not None:
        response.headers["traceparent"] = parent


async def _ending(body: AsyncIterator[bytes], span: Span) -> AsyncIterator[bytes]:
    try:
        async for chunk in body:
            yield chunk
    finally:
        span.end()


def parsed() -> None:
    """The handler began: the time since the request's arrival went to reading and
    validating its body (``ingress.parse``)."""
    t, root = tracer(), trace.get_current_span()
    start = getattr(root, "start_time", None)
    if t is not None and start is not None and root.is_recording():
        t.start_span("ingress.parse", start_time=start).end()


@contextlib.contextmanager
def span(name: str, **attributes: str | int | float | bool) -> Iterator[Span | None]:
    """A child of the current span for the ``with`` block (nothing when tracing is off)."""
    t = tracer()
    if t is None or not trace.get_current_span().is_recording():
        yield None
        return
    with t.start_as_current_span(name, attributes=attributes) as s:
        yield s


def annotate(**attributes: str | int | float | bool) -> None:
    """Attributes on the request's current span (its server span in the handler)."""
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


def engine_call(request_id: str, attempt: int, parent: Span) -> Span | None:
    """The client span of one send of a prompt to the engines, under the request's span
    ``parent`` (None: not traced); the caller ends it when that send's stream ends, and
    hands its ``traceparent`` on."""
    t = tracer()
    if t is None or not parent.is_recording():
        return None
    attributes = {"prefix_serve.request_id": request_id, "prefix_serve.attempt": attempt}
    inside = trace.set_span_in_context(parent)
    return t.start_span(
        "ingress.engine_call", context=inside, kind=SpanKind.CLIENT, attributes=attributes
    )


def routed(call: Span, note: RouteNote | None) -> None:
    """``router.decide`` under ``call``, as the router noted it (when it began, how long it
    took), and the replica on ``call``."""
    t = tracer()
    if t is None or note is None:
        return
    call.set_attribute("prefix_serve.replica", note.replica)
    start = int(note.decided_at * 1e9)
    decide = t.start_span(
        "router.decide",
        context=trace.set_span_in_context(call),
        start_time=start,
        attributes={
            "prefix_serve.routing.policy": note.policy,
            "prefix_serve.routing.reason": note.reason,
            "prefix_serve.routing.candidates": note.candidates,
            "prefix_serve.routing.replica": note.replica,
            "prefix_serve.routing.index": note.index,
            "prefix_serve.routing.predicted_cached_tokens": note.credit,
            "prefix_serve.reuse.reusable": -1 if note.reusable is None else note.reusable,
            "prefix_serve.reuse.routed": note.routed,
        },
    )
    decide.end(end_time=start + int(note.seconds * 1e9))
