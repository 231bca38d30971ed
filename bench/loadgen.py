"""Open-loop HTTP load: send a trace to the OpenAI API as an outside client would.

Each request is sent at its arrival time whether or not earlier ones finished, streamed
(``/v1/completions``, ``stream: true``, usage included), and timed: TTFT is the time to the
first chunk carrying text (our ingress sends its headers with it; Ray Serve LLM's direct
streaming sends them before any token, so timing the headers would flatter it).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from bench.workloads import TraceRequest


@dataclass
class RequestResult:
    request_id: str
    group: str
    status: int
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str | None = None
    trace_id: str | None = None  # the trace of a request the ingress traced (its answer says)


def drive(
    base_url: str,
    model: str,
    trace: Sequence[TraceRequest],
    timeout_s: float = 300.0,
    on_done: Callable[[int, int], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Replay ``trace``; returns the results in trace order and the makespan in seconds."""
    return asyncio.run(_drive(base_url, model, trace, timeout_s, on_done))


def warm_up(base_url: str, model: str, replicas: int, timeout_s: float) -> None:
    """A few short, unrelated requests, so no replica's first request is a timed one."""
    for i in range(4 * replicas):
        body = {"model": model, "prompt": f"warm up {i} {os.urandom(4).hex()}", "max_tokens": 2}
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)


def progress_printer(label: str) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr (a line per quarter when stderr is not a terminal)."""
    tty = sys.stderr.isatty()

    def show(done: int, total: int) -> None:
        if not tty and done != total and done % max(1, total // 4):
            return
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total or not tty:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


async def _drive(
    base_url: str,
    model: str,
    trace: Sequence[TraceRequest],
    timeout_s: float,
    on_done: Callable[[int, int], None] | None,
) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.monotonic()
        done = 0

        async def one(req: TraceRequest) -> RequestResult:
            nonlocal done
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
            result = await send(client, model, req)
            done += 1
            if on_done is not None:
                on_done(done, len(trace))
            return result

        results = await asyncio.gather(*(one(r) for r in trace))
        return list(results), time.monotonic() - start


def _request(model: str, req: TraceRequest) -> tuple[str, dict[str, object]]:
    """The endpoint and body for a trace request: a chat when it has a system prompt."""
    body: dict[str, object] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not req.system:
        return "/v1/completions", {**body, "prompt": req.prompt}
    messages = [{"role": "system", "content": req.system}, {"role": "user", "content": req.prompt}]
    return "/v1/chat/completions", {**body, "messages": messages}


def _has_text(chunk: dict) -> bool:
    choices = chunk.get("choices")
    if not choices:
        return False
    return bool(choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))


def new_traceparent() -> str:
    """A W3C ``traceparent`` that asks for the request to be traced (sampled flag set)."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"


def _trace_id(traceparent: str | None) -> str | None:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 else None


async def send(
    client: httpx.AsyncClient,
    model: str,
    req: TraceRequest,
    result: RequestResult | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, object] | None = None,
) -> RequestResult:
    """Send ``req`` (with ``headers``, and ``extra`` fields in its body) and time it into
    ``result`` (a caller that may cancel the send passes its own, and keeps what was
    measured before the cancel)."""
    path, body = _request(model, req)
    result = result or RequestResult(req.request_id, req.group, status=0)
    t0 = time.monotonic()
    try:
        async with client.stream("POST", path, json=body | (extra or {}), headers=headers) as resp:
            result.status = resp.status_code
            result.replica = resp.headers.get("x-replica-id")
            result.trace_id = _trace_id(resp.headers.get("traceparent"))
            if resp.status_code != 200:
                result.error = (await resp.aread()).decode(errors="replace")[:300]
                result.latency_s = time.monotonic() - t0
                return result
            headers_s = time.monotonic() - t0  # our ingress answers with the first token;
            last: float | None = None  # a peer may answer before it (Ray's direct streaming)
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.completion_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens", 0)
                elif _has_text(chunk):
                    now = time.monotonic()
                    if last is not None:
                        result.itl_s.append(now - last)
                    else:  # the first token: time to first token
                        result.ttft_s = now - t0
                    last = now
            if result.ttft_s is None:  # no text came (an empty answer): the headers' time
                result.ttft_s = headers_s
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.monotonic() - t0
    return result
