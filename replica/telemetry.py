"""Request traces (OpenTelemetry): off unless the standard ``OTEL_*`` variables configure
them, set up once per process (the ingress and each replica export their own spans).

On when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, or ``console`` to read spans
in a process's log), or, with that unset, when an OTLP endpoint is given
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); off with
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. OTLP goes over HTTP/protobuf
(the exporter this project installs; ``grpc`` is refused by name rather than silently
dropped). The SDK reads everything else itself: the sampler
(``OTEL_TRACES_SAMPLER=parentbased_traceidratio`` with ``OTEL_TRACES_SAMPLER_ARG``), the
batch processor's delays, headers and timeouts. A process whose variables say nothing pays
one dictionary read per request (``tracer()`` returns None).

The engine's clock is ``time.monotonic``; spans need the epoch: ``epoch_ns`` converts, with
the offset read once per process (the two clocks do not drift apart within a request).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:  # the SDK loads only where tracing is on
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("ray.serve")
_PROPAGATOR = TraceContextTextMapPropagator()
_state: dict[str, Tracer | None] = {}  # service -> its tracer (None: tracing is off)
_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def configured() -> bool:
    """Whether this process's ``OTEL_*`` variables turn traces on."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return any(env.get(name) for name in endpoints)


def tracer(service: str) -> Tracer | None:
    """This process's tracer (its provider set up at the first call), or None when off.
    ``service``: the ``service.name`` unless ``OTEL_SERVICE_NAME`` gives one."""
    if service not in _state:
        _state[service] = _setup(service) if configured() else None
    return _state[service]


def _setup(service: str) -> Tracer:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first service of this process
        name = os.environ.get("OTEL_SERVICE_NAME") or service
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        for exporter in _exporters():
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        log.info("tracing on: service %s, exporters %s", name, _exporter_names())
    return provider.get_tracer("prefix-serve")


def _exporter_names() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]


def _exporters() -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    for name in _exporter_names():
        if name == "otlp":
            protocol = os.environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            )
            if protocol != "http/protobuf":
                raise ValueError(
                    f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: only http/protobuf is installed"
                )
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={name}: use otlp, console or none")
    return exporters


def traceparent(span: Span) -> str | None:
    """``span``'s W3C ``traceparent`` (None: a span that is not recorded or sampled)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


def parent_context(traceparent: str | None) -> Context:
    """The context a ``traceparent`` header names (empty: a new trace)."""
    if not traceparent:
        return Context()
    return _PROPAGATOR.extract({"traceparent": traceparent})


def epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic`` reading as nanoseconds since the epoch."""
    return int(monotonic_s * 1e9) + _OFFSET_NS
