"""Optional API keys: with keys configured, every path but ``/health`` and ``/ready`` (the
probes) needs
``Authorization: Bearer <key>`` (what the openai SDK sends); otherwise a 401 in OpenAI form.

The keys live here, set by the ingress at start, and the middleware reads them here: Serve
pickles the ingress class by value, so shared state must sit in an importable module.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable

from fastapi import Request, Response

from cluster.api.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready"})
_keys: tuple[bytes, ...] = ()


def configure(keys: Iterable[str]) -> None:
    global _keys
    _keys = tuple(k.encode() for k in keys)


async def require_api_key(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    if _keys and request.url.path not in OPEN_PATHS:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        # compare against every key, always, so timing tells nothing about which one is near
        ok = [hmac.compare_digest(given, key) for key in _keys]
        if scheme.lower() != "bearer" or not any(ok):
            message = "Incorrect or missing API key: send 'Authorization: Bearer <key>'"
            return APIError(401, message, code="invalid_api_key").response()
    return await call_next(request)
