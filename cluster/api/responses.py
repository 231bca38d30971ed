"""OpenAI response bodies, whole or as server-sent events, built from engine chunks.

A completions request may hold a batch of prompts: each prompt is an engine request of its
own (they batch and share cached prefixes like any others), and choice ``j`` of prompt ``i``
is choice ``i * n + j`` of the reply, as OpenAI numbers them. ``usage`` sums the prompts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse

from cluster.api import metrics as api_metrics
from cluster.api.choice import Choice, TokenLogprobs
from cluster.api.errors import APIError, internal_error
from cluster.api.logprob_format import chat_logprobs, completion_logprobs
from cluster.api.models import ChatCompletionRequest, CompletionRequest
from cluster.api.tools import ToolCallStream
from cluster.engine_stream import EngineStream
from replica.checkpoints.tokenizer import IncrementalDetokenizer, Tokenizer
from replica.messages import RequestOutput

log = logging.getLogger("ray.serve")
T = TypeVar("T")


class Prompt:
    """One prompt of a reply: its ids, how many were cached, its echo and prompt logprobs."""

    def __init__(self, ids: list[int], first: RequestOutput, echo_text: str) -> None:
        self.ids = ids
        self.first = first
        self.num_cached = first.num_cached_tokens
        self.echo_text = echo_text
        self.logprobs: TokenLogprobs = []


class Reply:
    """Builds the OpenAI response (whole or as server-sent events) from engine chunks: one
    ``Choice`` per prompt and choice, each prompt counted once in ``usage``."""

    def __init__(
        self,
        kind: str,
        model: str,
        body: CompletionRequest | ChatCompletionRequest,
        tokenizer: Tokenizer,
        prompts: list[list[int]],
        firsts: list[RequestOutput],
    ) -> None:
        self.kind, self.model, self.request = kind, model, body
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.token_text = tokenizer.token_text
        echo = isinstance(body, CompletionRequest) and body.echo
        self.prompts = [
            Prompt(ids, first, tokenizer.decode(ids) if echo else "")
            for ids, first in zip(prompts, firsts, strict=True)
        ]
        score_only = isinstance(body, CompletionRequest) and body.max_tokens == 0
        self.choices = [
            Choice(
                p * body.n + j,
                IncrementalDetokenizer(tokenizer, prompt.ids),
                body.stop_list,
                body.stop_token_ids or (),
                score_only=score_only,
                calls=_tool_calls(body),
                chat=kind == "chat",
            )
            for p, prompt in enumerate(self.prompts)
            for j in range(body.n)
        ]

    async def _events(self, streams: list[EngineStream]) -> AsyncIterator[tuple[Choice, Any]]:
        """(choice, (new text, its logprobs)) until every choice has finished."""
        sources = [_chunks(p.first, s) for p, s in zip(self.prompts, streams, strict=True)]
        async for p, chunk in merge(sources):
            prompt = self.prompts[p]
            if chunk.prompt_logprobs is not None:
                prompt.logprobs = list(zip(prompt.ids, chunk.prompt_logprobs, strict=True))
            choice = self.choices[p * self.request.n + chunk.index]
            piece, logprobs = choice.push(chunk)
            if piece or logprobs or choice.finished:
                yield choice, (piece, logprobs)
            if all(c.finished for c in self.choices):
                self._account()
                return

    async def collect(self, streams: list[EngineStream]) -> None:
        async for _ in self._events(streams):
            pass

    async def sse(self, streams: list[EngineStream], request_id: str) -> AsyncIterator[str]:
        try:
            for choice in self.choices:  # the role (chat), or the echoed prompt
                prompt = self._prompt_of(choice)
                if self.kind == "chat":
                    yield _sse(self._chunk(choice, {"role": "assistant", "content": ""}, None))
                elif prompt.echo_text or prompt.logprobs:
                    yield _sse(self._chunk(choice, prompt.echo_text, prompt.logprobs))
            async for choice, (piece, logprobs) in self._events(streams):
                chat = self.kind == "chat"
                deltas: list[Any] = choice.deltas() if chat else [piece] if piece else []
                if logprobs and not deltas:  # a partial character: its logprobs still go
                    deltas = [{} if chat else ""]
                for delta in deltas:
                    yield _sse(self._chunk(choice, delta, logprobs))
                    logprobs = None
                if choice.finished:
                    yield _sse(self._chunk(choice, None, None, choice.finish_reason))
            options = self.request.stream_options
            if options is not None and options.include_usage:
                yield _sse({**self._envelope(), "choices": [], "usage": self.usage()})
        except APIError as exc:  # no replica could take the stream over
            yield _sse(exc.body())
        except Exception as exc:  # a bug: the client gets an id the log has, never a trace
            yield _sse(internal_error(exc, request_id).body())
        finally:  # a stop string or a gone client ends the stream early
            for stream in streams:
                stream.cancel()
        yield "data: [DONE]\n\n"

    def usage(self) -> dict[str, Any]:
        completion = sum(c.tokens for c in self.choices)
        prompt = sum(len(p.ids) for p in self.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(p.num_cached for p in self.prompts)},
        }

    def body(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            prompt = self._prompt_of(c)
            logprobs = self._logprobs(prompt.logprobs + c.logprobs)
            if self.kind == "chat":
                content = {"message": c.message()}
            else:
                content = {"text": prompt.echo_text + c.text.text}
            entry = {"index": c.index, **content, "finish_reason": c.finish_reason}
            choices.append({**entry, "logprobs": logprobs})
        return {**self._envelope(final=True), "choices": choices, "usage": self.usage()}

    def _prompt_of(self, choice: Choice) -> Prompt:
        return self.prompts[choice.index // self.request.n]

    def _logprobs(self, entries: TokenLogprobs) -> dict[str, Any] | None:
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
        delta: str | dict[str, Any] | None,
        logprobs: TokenLogprobs | None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        """One event of one choice: a delta (chat) or a text piece (completions); ``None``
        with ``finish``: the choice's last event."""
        formatted = self._logprobs(logprobs) if logprobs else None
        if self.kind == "chat":
            body = {"delta": delta if isinstance(delta, dict) else {}}
        else:
            body = {"text": delta or ""}
        entry = {"index": choice.index, **body, "finish_reason": finish, "logprobs": formatted}
        return {**self._envelope(), "choices": [entry]}

    def _account(self) -> None:
        api_metrics.PROMPT_TOKENS.inc(sum(len(p.ids) for p in self.prompts))
        api_metrics.CACHED_TOKENS.inc(sum(p.num_cached for p in self.prompts))
        api_metrics.COMPLETION_TOKENS.inc(sum(c.tokens for c in self.choices))


def _tool_calls(body: CompletionRequest | ChatCompletionRequest) -> ToolCallStream | None:
    if not isinstance(body, ChatCompletionRequest) or body.tool_mode == "none":
        return None
    choice = body.tool_choice
    named = None if isinstance(choice, str) or choice is None else choice.function.name
    return ToolCallStream(body.tool_mode, body.tools or [], named)


async def _chunks(first: RequestOutput, stream: EngineStream) -> AsyncIterator[RequestOutput]:
    yield first
    async for chunk in stream.rest():
        yield chunk


async def merge(sources: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several async iterators as they come, each with its source's index; the
    first error of any source is raised (the others are then cancelled)."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((i, item, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, done, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class ReleasingStreamingResponse(StreamingResponse):
    """Releases the admission slots once the stream is over, whether it ended or the client
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
