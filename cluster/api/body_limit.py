"""A cap on request bodies (``max_request_bytes``), enforced before a body is read whole.

A declared ``Content-Length`` over the cap is refused at once with a 413 in OpenAI form, the
body never read; a body sent without one (chunked) is read here as it arrives, at most the
cap, and refused at the chunk that crosses it; under the cap, the chunks read are handed to
the application as they came. (Refusing from inside the application's own read would not
do: FastAPI turns any error raised while it reads a body into a 400.) Like the API keys,
the cap lives in this module, set by the ingress at start (Serve pickles the ingress class
by value).
"""

from __future__ import annotations

from typing import Any

from cluster.api.errors import APIError
from cluster.config import ClusterArgs

_max_bytes = ClusterArgs.model_fields["max_request_bytes"].default


def configure(max_bytes: int) -> None:
    global _max_bytes
    _max_bytes = max_bytes


def too_large() -> APIError:
    return APIError(
        413,
        f"The request body is over this server's limit of {_max_bytes} bytes",
        code="request_too_large",
    )


class BodyLimit:
    """ASGI middleware: the cap, for every HTTP request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = _max_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            response = too_large().response() if declared.isdigit() else _bad_length()
            await response(scope, receive, send)
            return
        if declared is None:
            messages = await _read_capped(receive, limit)
            if messages is None:
                await too_large().response()(scope, receive, send)
                return
            receive = _replay(messages, receive)
        await self.app(scope, receive, send)


async def _read_capped(receive: Any, limit: int) -> list[dict[str, Any]] | None:
    """A body's messages up to its end, or None as soon as they pass ``limit`` bytes."""
    messages, seen = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        seen += len(message.get("body", b""))
        if seen > limit:
            return None
        if not message.get("more_body", False):
            return messages


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = iter(messages)

    async def replayed() -> dict[str, Any]:
        for message in pending:
            return message
        return await receive()  # after the body: a disconnect, when it comes

    return replayed


def _bad_length() -> Any:
    return APIError(400, "Content-Length: not a number", param="Content-Length").response()
