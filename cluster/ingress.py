"""The FastAPI ingress: the OpenAI-compatible HTTP API in front of the engine replicas.

It tokenizes each request once, computes its block hash chain once, and calls the engine
deployment through a handle with both, so the request router can route on the hashes.
Every error is an OpenAI error body with the right status; nothing reaches a replica that
the ingress can already tell is invalid.
"""

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster import tracing
from cluster.admission import Admission
from cluster.api import auth, body_limit
from cluster.api import metrics as api_metrics
from cluster.api.errors import APIError, install_handlers
from cluster.api.models import ChatCompletionRequest, CompletionRequest
from cluster.api.openapi import install_openapi
from cluster.api.responses import ReleasingStreamingResponse, Reply
from cluster.api.tools import template_messages, template_tools
from cluster.config import ClusterArgs
from cluster.dashboard import install_dashboard
from cluster.engine_stream import EngineStream
from cluster.gate import Gate
from cluster.metrics_share import MetricsShare
from cluster.moves import order_moves
from cluster.readiness import Readiness, readiness
from cluster.request_builder import RequestBuilder
from cluster.reuse import ReuseLedger, header, reuse_of
from cluster.tenants import key_records
from kvindex.reader import IndexReader
from replica.checkpoints import checkpoint_for
from replica.messages import EngineRequest, RequestOutput
from router.serve import link

app = FastAPI(
    title="prefix-serve",
    description="OpenAI-compatible, prefix-aware serving",
    **tracing.fastapi_options(),  # type: ignore[arg-type]
)
app.middleware("http")(tracing.trace_requests)  # inside the key check: traces what it admits
app.middleware("http")(auth.require_api_key)
app.add_middleware(body_limit.BodyLimit)  # outermost: before a key is checked or a body read
install_handlers(app)
install_dashboard(app)
# Serve pickles ``Ingress`` by value when it is decorated: helpers are defined above it, and
# shared state (metrics) is reached through its module, never bound as a global here.


def _replica_name() -> str | None:
    """This ingress replica's Serve id (None outside Serve)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica (a test building the class by hand)
        return None


async def first_chunks(streams: list[EngineStream]) -> list[RequestOutput]:
    """Every stream's first chunk, concurrently; on a failure the others are cancelled and
    the first error raised (nothing is left running in the engines)."""
    results = await asyncio.gather(*(s.first() for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for stream in streams:
            stream.cancel()
        raise errors[0]
    return results  # type: ignore[return-value]


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle, args: dict[str, Any] | ClusterArgs) -> None:
        self.args = ClusterArgs.model_validate(args)
        self.engine = engine.options(stream=True)
        self.tokenizer = checkpoint_for(self.args.engine.model).tokenizer()
        self.hasher = self.args.engine.block_hasher()
        self.model_id = self.args.engine.model_id
        self.started = int(time.time())
        self.admission = Admission(self.args, link.LINK.others_in_flight, link.LINK.engine_replicas)
        self.gate = Gate(self.args, self.admission)
        self.requests = RequestBuilder(self.args, self.hasher)
        self.index = IndexReader(self.args.index, self.model_id)  # readiness reads it
        self.ledger = ReuseLedger()
        tracing.tracer()  # set up before the first request (FastAPI's server span needs it)
        self.metrics_share = None  # with several ingress replicas: every one's in a scrape
        if self.args.ingress_replicas > 1:
            self.metrics_share = MetricsShare(
                self.args.index, self.model_id, generate_latest, _replica_name()
            ).start()
        auth.configure(r.key for r in key_records(self.args.api_keys))
        body_limit.configure(self.args.max_request_bytes)
        install_openapi(
            app, self.model_id, self.args.engine.shape.vocab_size, self.args.max_tokens_limit
        )

    def __del__(self) -> None:  # Serve stops the replica: its metrics leave the others',
        share = getattr(self, "metrics_share", None)  # its router's bookings the index
        if share is not None:
            share.stop()
        index = getattr(self, "index", None)
        if index is not None:
            index.close()
        link.LINK.close()

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        """Liveness: the ingress runs (``/ready`` says whether the cluster can serve)."""
        return {"status": "ok"}

    @app.get("/ready", response_model=Readiness)
    async def ready(self) -> JSONResponse:
        """Readiness (``cluster.readiness``): 200 with the report, else 503 saying why."""
        report = await readiness(self.args, link.LINK.engine_replicas, self.index)
        if report.ready:
            return JSONResponse(report.to_dict())
        error = APIError(503, f"not ready: {report.reason}", "server_error", code="not_ready")
        return JSONResponse({**error.body(), "readiness": report.to_dict()}, status_code=503)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "prefix-serve",
            "max_model_len": self.args.engine.context_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(self) -> Response:
        link.LINK.snapshot()  # refreshes the per-replica gauges
        if self.metrics_share is None:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
        text = await asyncio.to_thread(self.metrics_share.merged)  # every ingress's, labelled
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster/stats")
    async def cluster_stats(self) -> dict[str, Any]:
        """The request router's view of the engine replicas (routing stats lag ~1 period)."""
        return link.LINK.snapshot()

    @app.get("/cluster/decisions")
    async def cluster_decisions(
        self, limit: Annotated[int, Query(ge=0, le=512)] = 50
    ) -> dict[str, Any]:
        """This ingress replica's latest routing decisions with their reuse ledger
        (``cluster.reuse``), oldest first, and its totals."""
        return self.ledger.report(limit)

    @app.post("/cluster/replicas/{replica_id}/moves")
    async def cluster_moves(
        self,
        replica_id: str,
        to: str | None = None,
        max_streams: Annotated[int | None, Query(ge=1)] = None,
        push_timeout_s: Annotated[float | None, Query(gt=0, le=60)] = None,
    ) -> dict[str, Any]:
        """Move an engine replica's streams elsewhere now, token-exact (``cluster.moves``)."""
        live = set(link.LINK.snapshot().get("replicas", {}))
        return await order_moves(self.engine, live, replica_id, to, max_streams, push_timeout_s)

    @app.post("/v1/completions", response_model=None)
    async def completions(
        self, body: CompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        tracing.parsed()
        vocab = self.args.engine.shape.vocab_size
        prompts: list[tuple[list[int], str]] = []
        for prompt in body.prompts:
            if isinstance(prompt, str):
                # an empty text starts at the document boundary, as OpenAI's models do
                ids = self.tokenizer.encode(prompt) or [self.tokenizer.document_start_id]
                prompts.append((ids, prompt))
            elif any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            else:
                prompts.append((list(prompt), ""))
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await self._serve("completions", body, request, prompts, max_tokens)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        self, body: ChatCompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        tracing.parsed()
        with tracing.span("ingress.tokenize"):
            messages = template_messages(body, self.tokenizer.template_has_tools)
            text = self.tokenizer.render_chat(messages, template_tools(body))
            ids = self.tokenizer.encode_chat(text)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # as much as fits, up to the limit
            room = self.args.engine.context_len - len(ids)
            max_tokens = max(1, min(self.args.max_tokens_limit, room))
        return await self._serve("chat", body, request, [(ids, text)], max_tokens)

    async def _serve(
        self,
        kind: str,
        body: CompletionRequest | ChatCompletionRequest,
        request: Request,
        prompts: list[tuple[list[int], str]],
        max_tokens: int,
    ) -> JSONResponse | StreamingResponse:
        try:
            requests = self.requests.build(body, request, prompts, max_tokens)
            response = await self._respond(body, kind, request, requests)
        except APIError as exc:
            api_metrics.REQUESTS.labels(kind, str(exc.status)).inc()
            raise
        api_metrics.REQUESTS.labels(kind, "200").inc()
        return response

    async def _respond(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        kind: str,
        http: Request,
        requests: list[EngineRequest],
    ) -> JSONResponse | StreamingResponse:
        """Run a request's prompts in the engines, holding a slot for each (``cluster.gate``)
        until its stream is over."""
        arrived = time.monotonic()
        with tracing.span("ingress.admission"):
            admitted = await self.gate.enter(http, requests)
        tenant = admitted.tenant.name
        tracing.annotate(**{"prefix_serve.tenant": tenant, "prefix_serve.prompts": len(requests)})
        streams = [
            EngineStream(self.engine, r, self.hasher.chain, self.args.max_resumes) for r in requests
        ]
        release: Callable[[], None] | None = functools.partial(admitted.leave, streams)
        try:
            start = time.monotonic()
            firsts = await first_chunks(streams)
            for r in requests:
                link.LINK.prefill_done(r.request_id)
            api_metrics.TTFT.observe(time.monotonic() - start)
            api_metrics.TENANT_TTFT.labels(tenant).observe(time.monotonic() - arrived)
            prompts = [r.prompt_token_ids for r in requests]
            reply = Reply(kind, self.model_id, body, self.tokenizer, prompts, firsts)
            headers = self._headers(requests[0].request_id, firsts) | admitted.headers
            headers["x-prefix-reuse"] = self._account(tenant, streams, firsts)
            if body.stream:
                events = reply.sse(streams, requests[0].request_id)
                response = ReleasingStreamingResponse(
                    events, release, media_type="text/event-stream", headers=headers
                )
                release = None  # the response releases the slots when it is over
                return response
            try:
                await reply.collect(streams)
            finally:
                for stream in streams:
                    stream.cancel()
            return JSONResponse(reply.body(), headers=headers)
        finally:
            if release is not None:
                release()

    def _headers(self, request_id: str, firsts: list[RequestOutput]) -> dict[str, str]:
        """Where the prompts ran and (first prompt) why the router sent it there."""
        replicas = dict.fromkeys(first.replica_id for first in firsts)
        headers = {"x-replica-id": ",".join(replicas), "x-request-id": request_id}
        note = link.LINK.route_note(request_id)
        if note is not None and note.reason:  # the policy and its costs
            headers["x-routing"] = note.reason
        return headers

    def _account(
        self, tenant: str, streams: list[EngineStream], firsts: list[RequestOutput]
    ) -> str:
        """Each prompt's reuse in the ledger (and on the trace); the response's header."""
        entries = [
            reuse_of(s.request.request_id, tenant, s.note, first)
            for s, first in zip(streams, firsts, strict=True)
        ]
        for entry in entries:
            self.ledger.record(entry)
        known = [e.reusable for e in entries if e.reusable is not None]
        tracing.annotate(**{
            "prefix_serve.reuse.reusable": sum(known) if len(known) == len(entries) else -1,
            "prefix_serve.reuse.routed": sum(e.routed for e in entries),
            "prefix_serve.reuse.delivered": sum(e.delivered for e in entries),
            "prefix_serve.replica": ",".join(dict.fromkeys(e.replica for e in entries)),
        })  # fmt: skip
        return header(entries)
