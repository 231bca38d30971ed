"""A cap on request bodies (``max_request_bytes``), enforced before a body is read whole.

A declared ``Content-Length`` over the cap is refused at once with a 413 in OpenAI form, the
body never read; a body sent without one (chunked) is counted as it arrives and refused at
the chunk that crosses the cap. Like the API keys, the cap lives in this module, set by the
ingress at start (Serve pickles the ingress class by value).
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
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large()
            return message

        await self.app(scope, counted, send)


def _bad_length() -> Any:
    return APIError(400, "Content-Length: not a number", param="Content-Length").response()
