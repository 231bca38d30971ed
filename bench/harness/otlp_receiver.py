"""An OTLP/HTTP trace receiver: what a collector does with the spans our processes export,
kept in memory for a test or the tracing benchmark to read.

It speaks the protocol the OpenTelemetry exporters speak (``POST /v1/traces``, an
``ExportTraceServiceRequest`` in protobuf, gzip or not) and decodes it with the
OpenTelemetry proto package, so what a test reads is what any collector would have received.
``ReceiverProcess`` runs one in a process of its own (a benchmark's collector), answering
``GET /count``, ``GET /spans`` and ``POST /clear``; ``tracing_env`` is what a cluster is
started with to send it its traces.
"""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
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
                if self.path == "/clear":  # a benchmark between rounds
                    receiver.clear()
                    self._reply(b"", "text/plain")
                elif self.path == "/v1/traces":
                    receiver._add(decode(body))
                    reply = ExportTraceServiceResponse().SerializeToString()
                    self._reply(reply, "application/x-protobuf")
                else:  # metrics or logs: someone else's exporter
                    self.send_error(404)

            def do_GET(self) -> None:  # for another process: ``/count``, or ``/spans`` in JSON
                if self.path == "/count":
                    self._reply(str(len(receiver.spans())).encode(), "text/plain")
                elif self.path == "/spans":
                    spans = [asdict(s) for s in receiver.spans()]
                    self._reply(json.dumps(spans).encode(), "application/json")
                else:
                    self.send_error(404)

            def _reply(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

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
        with urllib.request.urlopen(f"{self.endpoint}/count", timeout=10) as reply:
            return int(reply.read())

    def settled(self, quiet_s: float = 7.0, limit_s: float = 30.0) -> int:
        """The spans received once none came for ``quiet_s`` (more than the batch
        processor's default 5 s delay), or after ``limit_s``."""
        deadline, last, count = time.monotonic() + limit_s, time.monotonic(), -1
        while time.monotonic() < deadline:
            now = self.count()
            if now != count:
                count, last = now, time.monotonic()
            elif time.monotonic() - last >= quiet_s:
                break
            time.sleep(0.5)
        return count

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far (``GET /spans``)."""
        with urllib.request.urlopen(f"{self.endpoint}/spans", timeout=30) as reply:
            rows = json.loads(reply.read())
        return [ReceivedSpan(**(row | {"events": tuple(row["events"])})) for row in rows]

    def clear(self) -> None:
        request = urllib.request.Request(f"{self.endpoint}/clear", method="POST", data=b"")
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _serve() -> None:
    """``python -m bench.harness.otlp_receiver``: a receiver that prints its endpoint and
    runs until SIGTERM or SIGINT."""
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # every thread: sigwait takes them
    receiver = OTLPReceiver().start()
    print(receiver.endpoint, flush=True)
    signal.sigwait(stops)
    receiver.stop()


def tracing_env(endpoint: str, ratio: float = 1.0, delay_ms: int | None = None) -> dict[str, str]:
    """The ``OTEL_*`` variables that trace a cluster's requests at ``ratio`` to an OTLP/HTTP
    receiver at ``endpoint`` (``delay_ms``: the batch processor's export delay, else its
    default 5 s)."""
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": str(ratio),
    }
    if delay_ms is not None:
        env["OTEL_BSP_SCHEDULE_DELAY"] = str(delay_ms)
    return env


if __name__ == "__main__":
    _serve()
