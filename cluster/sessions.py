"""Which agent session a request continues, and how long its blocks should be kept for the
next turn (``replica.engine.blocks.retention`` keeps them).

The session id comes from the first of these headers present: ours (``x-session-id``, the
one OpenCode sends), Dynamo's (``x-dynamo-session-id``), Claude Code's
(``x-claude-code-session-id``) and Codex's (``session-id``, ``thread-id``). It is qualified by
the tenant, so two tenants' sessions never share a name.

Retention is asked for per request, in the body (``cache_retention: {"ttl_s": 30}``) or a
header (``x-cache-retention-s: 30``). With a session id the session's next turn renews it
and its last releases it; without one the blocks are kept under a key of their own for
the TTL (as a prompt cache's TTL: nothing renews or ends it early). A session with no hint
gets ``sessions.default_retention_s``. The TTL is capped by the tenant's ``max_retention_s`` (else
the cluster's). ``x-session-final: true`` (or Dynamo's ``x-dynamo-session-final``) marks the
session's last turn: its blocks are released when it ends.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Mapping

from cluster.api.errors import APIError
from cluster.config import SessionsConfig
from cluster.tenants import Tenant
from replica.messages import Retention

SESSION_HEADERS = (
    "x-session-id",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
)
RETENTION_HEADER = "x-cache-retention-s"
FINAL_HEADERS = ("x-session-final", "x-dynamo-session-final")
SESSION_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


def session_id(headers: Mapping[str, str]) -> str | None:
    """The session a request continues (None: none named); a malformed id is a 400."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        if not SESSION_ID.fullmatch(value):
            raise APIError(400, f"{name} must be 1-128 printable ASCII characters", param=name)
        return value
    return None


def retention(
    config: SessionsConfig, tenant: Tenant, headers: Mapping[str, str], asked_s: float | None
) -> Retention | None:
    """The request's retention (the module docstring), or None when it keeps nothing."""
    asked_s = _asked(headers, asked_s)
    session = session_id(headers)
    if session is None:
        if not asked_s:  # no hint, or nothing to keep and no session to release
            return None
        session = "~" + secrets.token_hex(8)  # kept for its TTL alone
    final = any(headers.get(h, "").strip().lower() == "true" for h in FINAL_HEADERS)
    if asked_s is None and not final and config.default_retention_s <= 0:
        return None  # no hint, no default: it keeps nothing (an earlier turn's pin stays)
    ttl = 0.0 if final else config.default_retention_s if asked_s is None else asked_s
    bound = config.max_retention_s if tenant.max_retention_s is None else tenant.max_retention_s
    return Retention(f"{tenant.name}/{session}", tenant.name, min(ttl, bound))


def _asked(headers: Mapping[str, str], asked_s: float | None) -> float | None:
    """The TTL the body asked for, else the header's (a bad header is a 400)."""
    if asked_s is not None:
        return asked_s
    value = headers.get(RETENTION_HEADER)
    if value is None:
        return None
    try:
        ttl = float(value)
    except ValueError:
        ttl = math.nan
    if not math.isfinite(ttl) or ttl < 0:
        raise APIError(
            400, f"{RETENTION_HEADER} must be seconds, 0 or more", param=RETENTION_HEADER
        )
    return ttl
