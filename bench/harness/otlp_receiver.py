"""An OTLP/HTTP trace receiver: what a collector does with the spans our processes export,
kept in memory for a test or the tracing benchmark to read.

It speaks the protocol the OpenTelemetry exporters speak (``POST /v1/traces``, an
``ExportTraceServiceRequest`` in protobuf, gzip or not) and decodes it with the
OpenTelemetry proto package, so what a test reads is what any collector would have received.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as received: ids in hex ("" for a root's parent), times in ns since the epoch."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind is not None else None


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one export request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                spans.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        service=service,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=tuple(e.name for e in s.events),
                    )
                )
    return spans


class OTLPReceiver:
    """``start()`` listens on 127.0.0.1 (a free port); ``endpoint`` is what
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes; ``spans()`` all received so far."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.requests = 0
        self.paths: dict[str, int] = {}  # every POST's path, counted (404 but traces)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server calls it by this name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.paths[self.path] = receiver.paths.get(self.path, 0) + 1
                if self.path != "/v1/traces":  # metrics or logs: someone else's exporter
                    self.send_error(404)
                    return
                receiver._add(decode(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:  # quiet
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> OTLPReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans += spans
            self.requests += 1

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()


class ReceiverProcess:
    """An ``OTLPReceiver`` in a process of its own, as a collector runs beside a cluster: a
    benchmark's clients then share no interpreter (and no lock) with the decoding.
    ``count()`` asks it how many spans it has received (``GET /count``)."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.harness.otlp_receiver"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self.endpoint = self._proc.stdout.readline().strip()  # its first line: where
        if not self.endpoint.startswith("http://"):
            self.stop()
            raise RuntimeError(f"the receiver process said {self.endpoint!r}")

    def count(self) -> int:
        import urllib.request

        with urllib.request.urlopen(f"{self.endpoint}/count", timeout=10) as reply:
            return int(reply.read())

    def clear(self) -> None:
        import urllib.request

        request = urllib.request.Request(f"{self.endpoint}/clear", method="POST", data=b"")
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except Exception:
            self._proc.kill()
            self._proc.wait()


def _serve_counting() -> None:
    """``python -m bench.harness.otlp_receiver``: a receiver that prints its endpoint, then
    answers ``GET /count`` and ``POST /clear`` beside ``POST /v1/traces``."""
    import signal

    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # every thread: sigwait takes them
    receiver = OTLPReceiver()
    handler = receiver._server.RequestHandlerClass
    post = handler.do_POST

    def do_get(self: BaseHTTPRequestHandler) -> None:
        body = str(len(receiver.spans())).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_post(self: BaseHTTPRequestHandler) -> None:
        if self.path != "/clear":
            post(self)
            return
        receiver.clear()
        self.send_response(204)
        self.end_headers()

    handler.do_GET = do_get  # type: ignore[attr-defined]
    handler.do_POST = do_post  # type: ignore[method-assign]
    receiver.start()
    print(receiver.endpoint, flush=True)
    signal.sigwait(stops)
    receiver.stop()


if __name__ == "__main__":
    _serve_counting()
