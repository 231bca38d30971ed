"""OpenAI response bodies, whole or as server-sent events, built from engine chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from cluster import api_metrics
from cluster.api_errors import APIError
from cluster.api_models import ChatCompletionRequest, CompletionRequest
from cluster.engine_stream import EngineStream
from cluster.textstream import TextStream
from replica.messages import EngineChunk
from replica.tokenizer import IncrementalDetokenizer


class Reply:
    """Builds the OpenAI response (whole or as server-sent events) from engine chunks."""

    def __init__(
        self,
        kind: str,
        model: str,
        body: CompletionRequest | ChatCompletionRequest,
        detokenizer: IncrementalDetokenizer,
        num_prompt_tokens: int,
        first: EngineChunk,
    ) -> None:
        self.kind, self.model, self.request = kind, model, body
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = TextStream(detokenizer, body.stop_list)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached = first.num_cached_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._first = first

    async def _engine_chunks(self, stream: EngineStream) -> AsyncIterator[EngineChunk]:
        yield self._first
        async for chunk in stream.rest():
            yield chunk

    async def _chunks(self, stream: EngineStream) -> AsyncIterator[str]:
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

    async def collect(self, stream: EngineStream) -> None:
        async for _ in self._chunks(stream):
            pass

    async def sse(self, stream: EngineStream) -> AsyncIterator[str]:
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
        except APIError as exc:  # no replica could take the stream over
            error = {"message": exc.message, "type": exc.type, "code": exc.code}
            yield _sse({"error": error})
            yield "data: [DONE]\n\n"
        finally:  # a stop string or a gone client ends the stream early
            stream.cancel()

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
        api_metrics.PROMPT_TOKENS.inc(self.num_prompt_tokens)
        api_metrics.CACHED_TOKENS.inc(self.num_cached)
        api_metrics.COMPLETION_TOKENS.inc(self.completion_tokens)


class ReleasingStreamingResponse(StreamingResponse):
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
