"""OpenAI response bodies, whole or as server-sent events, built from engine chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from cluster.api import metrics as api_metrics
from cluster.api.choice import Choice, TokenLogprobs
from cluster.api.errors import APIError
from cluster.api.logprob_format import chat_logprobs, completion_logprobs
from cluster.api.models import ChatCompletionRequest, CompletionRequest
from cluster.engine_stream import EngineStream
from replica.checkpoints.tokenizer import IncrementalDetokenizer, Tokenizer
from replica.messages import RequestOutput


class Reply:
    """Builds the OpenAI response (whole or as server-sent events) from engine chunks: one
    ``Choice`` per choice, the prompt counted once in ``usage``."""

    def __init__(
        self,
        kind: str,
        model: str,
        body: CompletionRequest | ChatCompletionRequest,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        first: RequestOutput,
    ) -> None:
        self.kind, self.model, self.request = kind, model, body
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.token_text = tokenizer.token_text
        self.prompt_ids = prompt_ids
        self.num_cached = first.num_cached_tokens
        echo = isinstance(body, CompletionRequest) and body.echo
        self.echo_text = tokenizer.decode(prompt_ids) if echo else ""
        self.choices = [
            Choice(
                i,
                IncrementalDetokenizer(tokenizer, prompt_ids),
                body.stop_list,
                body.stop_token_ids or (),
                score_only=isinstance(body, CompletionRequest) and body.max_tokens == 0,
            )
            for i in range(body.n)
        ]
        self.prompt_logprobs: TokenLogprobs = []
        self._first = first

    async def _events(self, stream: EngineStream) -> AsyncIterator[tuple[Choice, str, Any]]:
        """(choice, new text, new tokens' logprobs) until every choice has finished."""
        chunks = self._engine_chunks(stream)
        async for chunk in chunks:
            if chunk.prompt_logprobs is not None:
                self.prompt_logprobs = list(
                    zip(self.prompt_ids, chunk.prompt_logprobs, strict=True)
                )
            choice = self.choices[chunk.index]
            piece, logprobs = choice.push(chunk)
            if piece or logprobs or choice.finished:
                yield choice, piece, logprobs
            if all(c.finished for c in self.choices):
                self._account()
                return

    async def _engine_chunks(self, stream: EngineStream) -> AsyncIterator[RequestOutput]:
        yield self._first
        async for chunk in stream.rest():
            yield chunk

    async def collect(self, stream: EngineStream) -> None:
        async for _ in self._events(stream):
            pass

    async def sse(self, stream: EngineStream) -> AsyncIterator[str]:
        try:
            for choice in self.choices:  # the role (chat), or the echoed prompt
                if self.kind == "chat":
                    yield _sse(self._chunk(choice, {"role": "assistant", "content": ""}, None))
                elif self.echo_text or self.prompt_logprobs:
                    yield _sse(self._chunk(choice, self.echo_text, self.prompt_logprobs))
            async for choice, piece, logprobs in self._events(stream):
                yield _sse(self._chunk(choice, piece, logprobs, choice.finish_reason))
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
        completion = sum(c.tokens for c in self.choices)
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.num_cached},
        }

    def body(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            logprobs = self._logprobs(self.prompt_logprobs + c.logprobs, c)
            if self.kind == "chat":
                content = {"message": {"role": "assistant", "content": c.text.text}}
            else:
                content = {"text": self.echo_text + c.text.text}
            choices.append(
                {
                    "index": c.index,
                    **content,
                    "finish_reason": c.finish_reason,
                    "logprobs": logprobs,
                }
            )
        return {**self._envelope(final=True), "choices": choices, "usage": self.usage()}

    def _logprobs(self, entries: TokenLogprobs, choice: Choice) -> dict[str, Any] | None:
        if not self._wants_logprobs():
            return None
        if self.kind == "chat":
            return chat_logprobs([e for _, e in entries if e is not None], self.token_text)
        return completion_logprobs(entries, self.token_text)

    def _wants_logprobs(self) -> bool:
        body = self.request
        return bool(body.logprobs) if self.kind == "chat" else body.logprobs is not None

    def _envelope(self, final: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion" if final else "chat.completion.chunk"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(
        self,
        choice: Choice,
        piece: str | dict[str, str],
        logprobs: TokenLogprobs | None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        formatted = self._logprobs(logprobs, choice) if logprobs else None
        if self.kind == "chat":
            delta = piece if isinstance(piece, dict) else {"content": piece}
            body = {"delta": delta}
        else:
            body = {"text": piece}
        entry = {"index": choice.index, **body, "finish_reason": finish, "logprobs": formatted}
        return {**self._envelope(), "choices": [entry]}

    def _account(self) -> None:
        api_metrics.PROMPT_TOKENS.inc(len(self.prompt_ids))
        api_metrics.CACHED_TOKENS.inc(self.num_cached)
        api_metrics.COMPLETION_TOKENS.inc(sum(c.tokens for c in self.choices))


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
