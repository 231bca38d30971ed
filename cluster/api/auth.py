"""Optional API keys: with keys configured, every path but ``/health`` and ``/ready`` (the
probes) needs ``Authorization: Bearer <key>`` (what the openai SDK sends) or, for a
browser, ``Authorization: Basic base64(<anything>:<key>)``; otherwise a 401 in OpenAI form.
On the dashboard's paths that 401 carries ``WWW-Authenticate: Basic``, so a browser asks
for the key once (as the password) and sends it with the page's fetches to ``/cluster/*``.

The keys live here, set by the ingress at start, and the middleware reads them here: Serve
pickles the ingress class by value, so shared state must sit in an importable module.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Awaitable, Callable, Iterable

from fastapi import Request, Response

from cluster.api.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready"})
DASHBOARD = "/dashboard"  # its paths challenge a browser to ask for the key
BASIC_CHALLENGE = {"www-authenticate": 'Basic realm="prefix-serve"'}
_keys: tuple[bytes, ...] = ()


def configure(keys: Iterable[str]) -> None:
    global _keys
    _keys = tuple(k.encode() for k in keys)


def given_key(header: str) -> bytes | None:
    """The key an ``Authorization`` header carries: a Bearer token, or a Basic password
    (its user is ignored); None for any other scheme or a malformed Basic value."""
    scheme, _, token = header.partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return token.strip().encode()
    if scheme != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _user, colon, password = decoded.partition(b":")
    return password if colon else None


def key_matches(given: bytes | None) -> bool:
    # compare against every key, always, so timing tells nothing about which one is near
    ok = [hmac.compare_digest(given or b"", key) for key in _keys]
    return given is not None and any(ok)


async def require_api_key(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    path = request.url.path
    if (
        _keys
        and path not in OPEN_PATHS
        and not key_matches(given_key(request.headers.get("authorization", "")))
    ):
        message = "Incorrect or missing API key: send 'Authorization: Bearer <key>'"
        browser = path == DASHBOARD or path.startswith(DASHBOARD + "/")
        headers = BASIC_CHALLENGE if browser else None
        return APIError(401, message, code="invalid_api_key", headers=headers).response()
    return await call_next(request)
