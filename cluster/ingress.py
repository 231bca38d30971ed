"""The FastAPI ingress: the OpenAI-compatible HTTP API in front of the engine replicas.

It tokenizes each request once, computes its block hash chain once, and calls the engine
deployment through a handle with both, so the request router can route on the hashes.
Every error is an OpenAI error body with the right status; nothing reaches a replica that
the ingress can already tell is invalid.
"""

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException

from cluster import auth, metrics
from cluster.chat_template import render_chat
from cluster.config import ClusterArgs
from cluster.protocol import ChatCompletionRequest, CompletionRequest
from cluster.textstream import TextStream
from replica.protocol import EngineChunk, EngineRequest, InvalidRequestError
from replica.sampling_params import SamplingParams
from replica.tokenizer import ByteTokenizer
from router import metrics as router_metrics

app = FastAPI(title="prefix-serve", description="OpenAI-compatible, prefix-aware serving")
app.middleware("http")(auth.require_api_key)
# Serve pickles ``Ingress`` by value when it is decorated: helpers are defined above it, and
# shared state (metrics) is reached through its module, never bound as a global here.


class APIError(Exception):
    """An error for the client, rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
    code = "json_invalid" if first.get("type") == "json_invalid" else "invalid_value"
    return APIError(400, message, code=code, param=".".join(loc) or None).response()


@app.exception_handler(HTTPException)
async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type_).response()


@app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    return APIError(500, "internal error", "server_error").response()


async def _start(
    engine: DeploymentHandle, request: EngineRequest
) -> tuple[DeploymentResponseGenerator, EngineChunk]:
    """Send a request and wait for its first chunk, turning what can go wrong before it
    (queue full, invalid for the engine, no replica) into an API error."""
    stream = engine.generate.remote(request)
    try:
        return stream, await stream.__anext__()
    except BaseException as exc:
        error = _api_error(exc)
        if error is None:  # cancelled (the client went away): cancel downstream too
            _cancel(stream)
            raise
        raise error from exc


def _cancel(stream: DeploymentResponseGenerator) -> None:
    """Best effort: a stream whose routing failed re-raises that failure on cancel."""
    with contextlib.suppress(Exception):
        stream.cancel()


def _api_error(exc: BaseException) -> APIError | None:
    if isinstance(exc, BackPressureError):
        return APIError(
            503,
            "The server is overloaded; retry later",
            "overloaded_error",
            code="overloaded",
            headers={"retry-after": "1"},
        )
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, ray.exceptions.RayError):
        return APIError(503, "No engine replica could serve the request", "server_error")
    return None


class _Reply:
    """Builds the OpenAI response (whole or as server-sent events) from engine chunks."""

    def __init__(
        self,
        kind: str,
        model: str,
        body: CompletionRequest | ChatCompletionRequest,
        num_prompt_tokens: int,
        first: EngineChunk,
    ) -> None:
        self.kind, self.model, self.request = kind, model, body
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = TextStream(body.stop_list)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached = first.num_cached_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._first = first

    async def _engine_chunks(
        self, stream: DeploymentResponseGenerator
    ) -> AsyncIterator[EngineChunk]:
        yield self._first
        async for chunk in stream:
            yield chunk

    async def _chunks(self, stream: DeploymentResponseGenerator) -> AsyncIterator[str]:
        """Text pieces until the engine finishes or a stop string appears."""
        async for chunk in self._engine_chunks(stream):
            self.completion_tokens += len(chunk.token_ids)
            piece = self.text.push(chunk.token_ids)
            if self.text.stopped:
                self.finish_reason = "stop"
            elif chunk.finished:
                piece += self.text.flush()
                self.finish_reason = "stop" if self.text.stopped else chunk.finish_reason
            if piece:
                yield piece
            if self.finish_reason is not None:
                self._account()
                return

    async def collect(self, stream: DeploymentResponseGenerator) -> None:
        async for _ in self._chunks(stream):
            pass

    async def sse(self, stream: DeploymentResponseGenerator) -> AsyncIterator[str]:
        try:
            if self.kind == "chat":
                yield _sse(self._chunk_body({"role": "assistant", "content": ""}, None))
            async for piece in self._chunks(stream):
                yield _sse(self._chunk_body(piece, None))
            yield _sse(self._chunk_body("" if self.kind != "chat" else {}, self.finish_reason))
            options = self.request.stream_options
            if options is not None and options.include_usage:
                yield _sse({**self._envelope(), "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        except ray.exceptions.RayError:
            error = {"message": "the engine replica failed mid-stream", "type": "server_error"}
            yield _sse({"error": error})
            yield "data: [DONE]\n\n"
        finally:  # a stop string or a gone client ends the stream early
            _cancel(stream)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached},
        }

    def body(self) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text.text},
                "finish_reason": self.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {
                "index": 0,
                "text": self.text.text,
                "finish_reason": self.finish_reason,
                "logprobs": None,
            }
        return {**self._envelope(final=True), "choices": [choice], "usage": self.usage()}

    def _envelope(self, final: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion" if final else "chat.completion.chunk"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk_body(self, piece: str | dict[str, str], finish: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            delta = piece if isinstance(piece, dict) else {"content": piece}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
        return {**self._envelope(), "choices": [choice]}

    def _account(self) -> None:
        metrics.PROMPT_TOKENS.inc(self.num_prompt_tokens)
        metrics.CACHED_TOKENS.inc(self.num_cached)
        metrics.COMPLETION_TOKENS.inc(self.completion_tokens)


class _Admission:
    """Requests this ingress has in the engines, capped so overload is refused at the door
    (503 at once) instead of waiting in a queue: replicas x ``max_ongoing_requests`` plus
    ``max_queued_requests`` (no cap when that is -1)."""

    def __init__(self, args: ClusterArgs) -> None:
        queued = args.max_queued_requests
        slots = args.num_replicas * args.max_ongoing_requests
        self.limit = None if queued < 0 else slots + queued
        self.in_flight = 0

    def enter(self) -> None:
        if self.limit is not None and self.in_flight >= self.limit:
            raise _api_error(BackPressureError(self.in_flight, self.limit))
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1


class _ReleasingStreamingResponse(StreamingResponse):
    """Releases the admission slot once the stream is over, whether it ended or the client
    went away (Starlette always calls the response it was handed)."""

    def __init__(
        self, content: AsyncIterator[str], release: Callable[[], None], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle, args: dict[str, Any] | ClusterArgs) -> None:
        self.args = ClusterArgs.model_validate(args)
        self.engine = engine.options(stream=True)
        self.tokenizer = ByteTokenizer()
        self.hasher = self.args.engine.block_hasher()
        self.model_id = self.args.engine.model_id
        self.started = int(time.time())
        self.admission = _Admission(self.args)
        auth.configure(self.args.api_keys)

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {"id": self.model_id, "object": "model", "created": self.started}
        return {"object": "list", "data": [{**card, "owned_by": "prefix-serve"}]}

    @app.get("/metrics")
    async def metrics(self) -> Response:
        router_metrics.STATE.replica_stats()  # refresh the per-replica gauges
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster/stats")
    async def cluster_stats(self) -> dict[str, Any]:
        """The request router's view of the engine replicas (routing stats lag ~1 period)."""
        return router_metrics.STATE.snapshot()

    @app.post("/v1/completions", response_model=None)
    async def completions(
        self, body: CompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            vocab = self.args.engine.model.vocab_size
            if not prompt or any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            ids, text = list(prompt), ""
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await self._serve("completions", body, request, ids, text, max_tokens)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        self, body: ChatCompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        text = render_chat(body.messages)
        ids = self.tokenizer.encode(text)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # as much as fits, up to the limit
            room = (self.args.engine.max_model_len or 0) - len(ids)
            max_tokens = max(1, min(self.args.max_tokens_limit, room))
        return await self._serve("chat", body, request, ids, text, max_tokens)

    async def _serve(
        self,
        kind: str,
        body: CompletionRequest | ChatCompletionRequest,
        request: Request,
        ids: list[int],
        text: str,
        max_tokens: int,
    ) -> JSONResponse | StreamingResponse:
        try:
            engine_request = self._engine_request(body, request, ids, text, max_tokens)
            response = await self._respond(body, kind, engine_request)
        except APIError as exc:
            metrics.REQUESTS.labels(kind, str(exc.status)).inc()
            raise
        metrics.REQUESTS.labels(kind, "200").inc()
        return response

    async def _respond(
        self, body: CompletionRequest | ChatCompletionRequest, kind: str, request: EngineRequest
    ) -> JSONResponse | StreamingResponse:
        """Run a request in the engines, holding an admission slot until its stream is over."""
        self.admission.enter()
        release: Callable[[], None] | None = self.admission.leave
        try:
            start = time.monotonic()
            stream, first = await _start(self.engine, request)
            metrics.TTFT.observe(time.monotonic() - start)
            reply = _Reply(kind, self.model_id, body, len(request.prompt_token_ids), first)
            headers = {"x-replica-id": first.replica_id}
            if body.stream:
                response = _ReleasingStreamingResponse(
                    reply.sse(stream), release, media_type="text/event-stream", headers=headers
                )
                release = None  # the response releases the slot when it is over
                return response
            try:
                await reply.collect(stream)
            finally:
                _cancel(stream)
            return JSONResponse(reply.body(), headers=headers)
        finally:
            if release is not None:
                release()

    def _engine_request(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        request: Request,
        ids: list[int],
        text: str,
        max_tokens: int,
    ) -> EngineRequest:
        if body.model != self.model_id:
            raise APIError(
                404,
                f"The model '{body.model}' does not exist; this server serves '{self.model_id}'",
                code="model_not_found",
                param="model",
            )
        limit = self.args.max_tokens_limit
        if not 1 <= max_tokens <= limit:
            raise APIError(400, f"max_tokens must be in [1, {limit}]", param="max_tokens")
        engine = self.args.engine
        assert engine.max_model_len is not None
        if len(ids) + max_tokens > engine.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {engine.max_model_len} tokens; "
                f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}",
                code="context_length_exceeded",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        salt = body.cache_salt or request.headers.get("x-cache-salt") or None
        chain = self.hasher.chain(ids, salt)
        k = self.args.routing.affinity_blocks
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        return EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=ids,
            params=params,
            block_hashes=chain,
            affinity_key=self.hasher.affinity_key(ids, k, salt, chain),
            cache_salt=salt,
            prompt=text,
        )
