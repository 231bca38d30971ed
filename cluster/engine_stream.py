"""One request's stream of engine chunks, which survives the death of its replica.

The ingress holds everything a continuation needs: the prompt's token ids, the tokens the
client has already received, and the sampling parameters with a seed (the ingress assigns
one when the client gives none). When the replica dies (its actor is gone, or its stream
breaks) the request is sent again: before its first token exactly as it was; after, as a
continuation (prompt + delivered tokens, hashed again so the router finds a replica that
caches them). The engine counts the delivered tokens as output and its sampler is keyed by
position, so the client sees one uninterrupted stream, token for token what it would have
been, with no token twice and ``usage`` counting each once. At most ``max_resumes`` sends
after the first; a request whose client went away is never resumed (its cancellation ends
the stream here). A request with ``n`` > 1 choices is resent before its first token, but
not resumed mid-stream (its choices would each need a continuation): it fails cleanly.

A replica can also hand a stream on while it lives (``replica.moves``: it leaves, or is too
busy): its last chunk there carries a ``Move`` instead of a token, and the request goes on
as a continuation in the same way, first to the replica that took its KV. A move is not a
failure: it counts in ``prefix_serve_moved_requests_total``, not against ``max_resumes``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import ray
from opentelemetry import trace
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cluster import tracing
from cluster.api import metrics as api_metrics
from cluster.api.errors import engine_error, replica_failed
from replica import telemetry
from replica.errors import InvalidRequestError, RequestFailedError
from replica.messages import EngineRequest, RequestOutput
from router.routing_stats import RouteNote
from router.serve import link

NOTE_WAIT_S = 0.02  # for the router's note of a request that went to another than its first


class EngineStream:
    def __init__(
        self,
        engine: DeploymentHandle,
        request: EngineRequest,
        rehash: Callable[[list[int], str | None], list[bytes]],
        max_resumes: int,
    ) -> None:
        self.request = request
        self.resumes = 0
        self._engine = engine
        self._rehash = rehash  # a block chain under a salt: BlockHasher.chain
        self._max_resumes = max_resumes
        self._delivered: list[int] = []
        self._stream: DeploymentResponseGenerator | None = None
        self.cached_tokens = 0  # prompt tokens the first replica served from its cache
        self.note: RouteNote | None = None  # the routing of the send that answered first
        self._traced = trace.get_current_span()  # the request's span: each send's parent
        self._call: trace.Span | None = None  # the current send's span (traced requests)
        self._resent = False  # resumed mid-stream, its new send's first chunk not yet seen

    async def first(self) -> RequestOutput:
        """Send the request and wait for its first chunk, turning what can go wrong before it
        (invalid for the engine, no replica left) into an API error."""
        while True:
            self._stream = self._send(self.request)
            try:
                chunk = await self._stream.__anext__()
            except ray.exceptions.RayActorError:
                self._resume_or_fail("before_first_token")
                continue
            except BaseException as exc:
                error = engine_error(exc, self.request.request_id)
                if error is None:  # cancelled (the client went away): cancel downstream too
                    self.cancel()
                    raise
                self._end_call(failed=type(exc).__name__)
                raise error from exc
            if chunk.moved is not None:  # stopped there before its first token: on elsewhere
                self._stream = self._send(self._moved_on(chunk))
                continue
            self._delivered += chunk.new_token_ids if chunk.index == 0 else []
            self.cached_tokens = chunk.num_cached_tokens
            self.note = await self._routed(chunk)
            return chunk

    async def _routed(self, chunk: RequestOutput) -> RouteNote | None:
        """The first chunk of a send came: its routing, on its span (when traced)."""
        note = await self._note(chunk.replica_id)
        if self._call is not None:
            tracing.routed(self._call, note)
            self._call.set_attribute("prefix_serve.replica", chunk.replica_id)
        return note

    async def _note(self, replica_id: str) -> RouteNote | None:
        """The router's note of this request's routing to ``replica_id``: noted at the
        decision for its first choice, and again when Serve reports it went elsewhere (a
        report that can come just after the first token: waited for, briefly)."""
        note = link.LINK.route_note(self.request.request_id)
        waited = 0.0
        while note is not None and note.replica != replica_id and waited < NOTE_WAIT_S:
            await asyncio.sleep(0.002)
            waited += 0.002
            note = link.LINK.route_note(self.request.request_id)
        return note

    async def rest(self) -> AsyncIterator[RequestOutput]:
        """The chunks after the first, across resumes, until the one marked finished."""
        while True:
            assert self._stream is not None
            try:
                async for chunk in self._stream:
                    if chunk.moved is not None:  # its replica handed it on: the last chunk
                        self._stream = self._send(self._moved_on(chunk))
                        self._resent = True
                        break
                    if self._resent:  # the first chunk of a resumed send
                        self._resent = False
                        await self._routed(chunk)
                    self._delivered += chunk.new_token_ids if chunk.index == 0 else []
                    yield chunk
                else:
                    self._end_call()
                    return
            except ray.exceptions.RayError as exc:
                cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else None
                if isinstance(cause, InvalidRequestError | RequestFailedError):  # anywhere
                    self._end_call(failed=type(cause).__name__)
                    raise engine_error(exc, self.request.request_id) from None
                if self.request.params.n > 1:  # several choices in flight: not resumable
                    self._resume_or_fail("mid_stream", give_up=True)
                self._resume_or_fail("mid_stream")
                self._stream = self._send(self._continuation())
                self._resent = True

    @property
    def delivered_tokens(self) -> int:
        """Tokens of choice 0 the client has been sent so far."""
        return len(self._delivered)

    def _send(self, request: EngineRequest) -> DeploymentResponseGenerator:
        """One send (a span of its own when traced, whose ``traceparent`` goes with it)."""
        self._end_call()
        self._call = tracing.engine_call(self.request.request_id, self.resumes, self._traced)
        if self._call is not None:
            request = replace(request, trace_parent=telemetry.traceparent(self._call))
        with link.call_id(f"{self.request.request_id}.{self.resumes}"):
            return self._engine.generate.remote(request)

    def _end_call(self, failed: str | None = None) -> None:
        call, self._call = self._call, None
        if call is not None:
            if failed is not None:
                call.set_attribute("prefix_serve.failed", failed)
                call.set_status(trace.Status(trace.StatusCode.ERROR, failed))
            call.end()

    def cancel(self) -> None:
        """Best effort: a stream whose routing failed re-raises that failure on cancel."""
        self._end_call()
        if self._stream is not None:
            with contextlib.suppress(Exception):
                self._stream.cancel()

    def _resume_or_fail(self, when: str, give_up: bool = False) -> None:
        if self._call is not None:  # the replica it was on, by the router's latest note
            note = link.LINK.route_note(self.request.request_id)
            if note is not None:
                self._call.set_attribute("prefix_serve.replica", note.replica)
            self._end_call(failed=f"replica_died_{when}")
        self.cancel()
        if give_up or self.resumes >= self._max_resumes:
            api_metrics.RESUMES.labels(when, "given_up").inc()
            raise replica_failed() from None
        self.resumes += 1
        api_metrics.RESUMES.labels(when, "resumed").inc()

    def _moved_on(self, chunk: RequestOutput) -> EngineRequest:
        """The request again after its replica moved it (``replica.moves``): a
        continuation, first to the replica that took its KV."""
        move = chunk.moved
        assert move is not None
        outcome = "pushed" if move.target is not None else "recomputed"
        api_metrics.MOVES.labels(move.reason, outcome).inc()
        if self._call is not None:
            self._call.set_attribute("prefix_serve.replica", chunk.replica_id)
            self._call.set_attribute("prefix_serve.moved", f"{move.reason}:{outcome}")
            self._call.set_attribute("prefix_serve.moved_tokens", move.tokens)
        return replace(self._continuation(), prefer_replica_id=move.target)

    def _continuation(self) -> EngineRequest:
        """The request again, carrying what the client already has."""
        delivered = list(self._delivered)
        chain = self._rehash(self.request.prompt_token_ids + delivered, self.request.cache_salt)
        # the replica computes the delivered tokens like the prompt: the router books them so
        route = replace(
            self.request.route,
            block_hashes=chain,
            num_prompt_tokens=len(self.request.prompt_token_ids) + len(delivered),
            max_tokens=self.request.route.max_tokens - len(delivered),
        )
        return replace(self.request, output_token_ids=delivered, route=route)
