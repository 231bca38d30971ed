"""The ingress's side of a replica's death, step by step: ``EngineStream`` against a scripted
deployment handle whose replicas die exactly where a test says. (``test_failover.py`` kills a
real replica mid-generation; the paths here are those a kill cannot hit on purpose: a death
before the first token, running out of resumes, and choices that cannot be resumed.)"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator

import pytest
import ray.exceptions
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.api import metrics as api_metrics
from cluster.api.errors import APIError, install_handlers
from cluster.engine_stream import EngineStream
from kvindex.hashing import BlockHasher
from kvindex.records import RoutingRequest
from replica.errors import RequestFailedError
from replica.messages import EngineRequest, RequestOutput
from replica.sampling.params import SamplingParams

HASHER = BlockHasher(4, "test-model")
PROMPT = list(range(10))
DIES = object()  # in a script: the replica dies here
FAILS = object()  # in a script: the request fails in the engine (``RequestFailedError``)


class ScriptedCall:
    """One ``generate.remote`` call: yields its script's tokens as chunks, or dies."""

    def __init__(self, request: EngineRequest, script: list[object]) -> None:
        self.request = request
        self._script: Iterator[object] = iter(script)
        self.cancelled = False

    def __aiter__(self) -> ScriptedCall:
        return self

    async def __anext__(self) -> RequestOutput:
        step = next(self._script, None)
        if step is None:
            raise StopAsyncIteration
        if step is DIES:
            raise ray.exceptions.RayActorError()
        if step is FAILS:  # what crosses Ray from the replica's generator
            raise ray.exceptions.RayTaskError(
                "generate", "traceback text", RequestFailedError("RuntimeError: boom")
            ).as_instanceof_cause()
        tokens, finished, index = step  # type: ignore[misc]
        return RequestOutput(
            self.request.request_id, tokens, [], finished, "length" if finished else None,
            len(PROMPT), 0, index, replica_id="replica",
        )  # fmt: skip

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedHandle:
    """Stands in for ``DeploymentHandle(EngineReplica)``: the n-th send follows script n."""

    def __init__(self, *scripts: list[object]) -> None:
        self._scripts = list(scripts)
        self.calls: list[ScriptedCall] = []
        self.generate = self  # handle.generate.remote(request)

    def remote(self, request: EngineRequest) -> ScriptedCall:
        call = ScriptedCall(request, self._scripts[len(self.calls)])
        self.calls.append(call)
        return call


def request(n: int = 1) -> EngineRequest:
    route = RoutingRequest("req-1", HASHER.chain(PROMPT), b"k", len(PROMPT), 16, 4)
    return EngineRequest("req-1", PROMPT, SamplingParams(max_tokens=4, n=n, seed=5), route)


def read_all(stream: EngineStream) -> list[RequestOutput]:
    async def go() -> list[RequestOutput]:
        chunks = [await stream.first()]
        chunks += [c async for c in stream.rest()]
        return chunks

    return asyncio.run(go())


def given_up(when: str) -> float:
    return api_metrics.RESUMES.labels(when, "given_up")._value.get()


def test_a_replica_dying_before_the_first_token_gets_the_request_resent_unchanged() -> None:
    handle = ScriptedHandle([DIES], [([7], False, 0), ([8, 9], True, 0)])
    stream = EngineStream(handle, request(), HASHER.chain, max_resumes=2)  # type: ignore[arg-type]
    chunks = read_all(stream)
    assert [c.new_token_ids for c in chunks] == [[7], [8, 9]]
    first, second = handle.calls
    assert second.request == first.request  # nothing delivered yet: the same request
    assert first.cancelled and stream.resumes == 1


def test_a_replica_dying_mid_stream_is_continued_from_what_the_client_has() -> None:
    handle = ScriptedHandle(
        [([7], False, 0), ([8], False, 0), DIES], [([9], False, 0), ([10], True, 0)]
    )
    stream = EngineStream(handle, request(), HASHER.chain, max_resumes=2)  # type: ignore[arg-type]
    assert [c.new_token_ids for c in read_all(stream)] == [[7], [8], [9], [10]]
    continuation = handle.calls[1].request
    assert continuation.request_id == "req-1" and continuation.prompt_token_ids == PROMPT
    assert continuation.output_token_ids == [7, 8]
    # hashed again over prompt + delivered tokens, so the router finds them where cached
    assert continuation.route.block_hashes == HASHER.chain([*PROMPT, 7, 8])
    # what the router books: the delivered tokens are computed like the prompt, and the
    # request still holds at most the blocks of its prompt and max_tokens
    assert continuation.route.num_prompt_tokens == len(PROMPT) + 2
    assert continuation.route.decode_blocks == stream.request.route.decode_blocks
    assert len(continuation.route.block_hashes) == 3 and stream.resumes == 1


def test_resumes_are_bounded_then_the_request_fails_as_replica_failed() -> None:
    before = given_up("before_first_token")
    handle = ScriptedHandle([DIES], [DIES], [DIES], [([1], True, 0)])
    stream = EngineStream(handle, request(), HASHER.chain, max_resumes=2)  # type: ignore[arg-type]
    with pytest.raises(APIError) as failed:
        read_all(stream)
    assert len(handle.calls) == 3  # the first send and two resumes, never a fourth
    error = failed.value
    assert (error.status, error.code) == (503, "replica_failed")
    assert given_up("before_first_token") == before + 1
    none = EngineStream(ScriptedHandle([DIES]), request(), HASHER.chain, max_resumes=0)  # type: ignore[arg-type]
    with pytest.raises(APIError, match="retry"):
        read_all(none)


def test_several_choices_are_resent_before_their_first_token_but_not_resumed_mid_stream() -> None:
    before = given_up("mid_stream")
    early = ScriptedHandle([DIES], [([1], True, 0), ([2], True, 1)])
    stream = EngineStream(early, request(n=2), HASHER.chain, max_resumes=2)  # type: ignore[arg-type]
    assert [(c.index, c.new_token_ids) for c in read_all(stream)] == [(0, [1]), (1, [2])]
    late = ScriptedHandle([([1], False, 0), ([2], False, 1), DIES], [([3], True, 0)])
    stream = EngineStream(late, request(n=2), HASHER.chain, max_resumes=2)  # type: ignore[arg-type]
    with pytest.raises(APIError) as failed:
        read_all(stream)
    assert failed.value.code == "replica_failed" and len(late.calls) == 1
    assert given_up("mid_stream") == before + 1


def test_a_request_that_failed_in_the_engine_is_a_500_and_never_resent() -> None:
    """It would fail on any replica (its own numbers or state): resending it could only
    take more replicas' time; before the first token and after it alike."""
    for script in ([FAILS], [([7], False, 0), FAILS]):
        handle = ScriptedHandle(script, [([1], True, 0)])
        stream = EngineStream(handle, request(), HASHER.chain, max_resumes=2)  # type: ignore[arg-type]
        with pytest.raises(APIError) as failed:
            read_all(stream)
        assert (failed.value.status, failed.value.code) == (500, "internal_error")
        assert len(handle.calls) == 1 and stream.resumes == 0


def test_an_internal_error_is_a_500_in_the_openai_shape_without_a_stack_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The handlers the ingress installs, on an app whose route fails unexpectedly: the
    client learns that it failed and under which id, not how (no traceback, no exception
    text); the server's log has the trace under that id."""
    app = FastAPI()
    install_handlers(app)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret detail from /internal/path.py")

    with caplog.at_level(logging.ERROR):
        resp = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "server_error",
        None,
        "internal_error",
    )
    request_id = re.fullmatch(
        r"The server had an internal error; it logged it as request (\w+)", error["message"]
    ).group(1)
    assert "Traceback" not in resp.text and "secret" not in resp.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])
