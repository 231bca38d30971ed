"""Per-tenant quotas shared by every ingress replica: requests per minute and tokens per
minute as token buckets, and requests in flight, in Redis, checked and taken by one Lua
script (atomic: two ingresses never both take the last token).

A bucket holds up to its per-minute limit and refills continuously (limit / 60 s); a
request takes one request and its estimated tokens (prompt tokens no replica holds, plus
``max_tokens``) from its tenant's buckets, or none of them, and when it ends the tokens are
corrected to what it really cost (a bucket may go below zero: a request that cost more than
estimated is paid back by the tenant's next ones). Requests in flight are a sorted set of
request ids with an expiry, so those of an ingress that died stop counting.

A refusal is OpenAI's: 429, ``code: rate_limit_exceeded``, ``type: requests`` or
``tokens``, ``Retry-After``; every answer of a limited tenant carries the
``x-ratelimit-limit-*``, ``x-ratelimit-remaining-*`` and ``x-ratelimit-reset-*`` headers.
If Redis cannot be reached the request passes (counted in ``quota_unchecked``): quotas
protect the cluster's share, not its availability.
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass, field

import redis.asyncio
from redis.exceptions import RedisError

from cluster.api.errors import APIError
from cluster.tenants import Tenant, TenantLimits

log = logging.getLogger("ray.serve")
IN_FLIGHT_TTL_MS = 600_000  # a request in flight longer than this stops counting

# KEYS: the requests bucket, the tokens bucket, the in-flight set. ARGV: requests limit,
# tokens limit, concurrent limit (0: none), tokens wanted, request id. Returns {ok, which
# limit refused ('' if none), requests level, tokens level, in flight}.
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, cap)
  if cap <= 0 then return 0 end
  local v = redis.call('HMGET', key, 'level', 'at')
  local l, at = tonumber(v[1]) or cap, tonumber(v[2]) or now
  return math.min(cap, l + (now - at) * cap / 60000)
end
local rcap, tcap, ccap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local r, tk = level(KEYS[1], rcap), level(KEYS[2], tcap)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local c = redis.call('ZCARD', KEYS[3])
local refused = ''
if rcap > 0 and r < 1 then refused = 'requests'
elseif tcap > 0 and tk < want then refused = 'tokens'
elseif ccap > 0 and c >= ccap then refused = 'concurrent' end
if refused == '' then
  if rcap > 0 then r = r - 1 end
  if tcap > 0 then tk = tk - want end
  if ccap > 0 then
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
    redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]))
    c = c + 1
  end
end
for i, pair in ipairs({{KEYS[1], rcap, r}, {KEYS[2], tcap, tk}}) do
  if pair[2] > 0 then
    redis.call('HSET', pair[1], 'level', tostring(pair[3]), 'at', now)
    redis.call('PEXPIRE', pair[1], 120000)
  end
end
return {refused == '' and 1 or 0, refused, tostring(r), tostring(tk), c}
"""

# KEYS: the tokens bucket, the in-flight set. ARGV: tokens limit, tokens to give back
# (negative: to take), request id.
SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap = tonumber(ARGV[1])
if cap > 0 then
  local v = redis.call('HMGET', KEYS[1], 'level', 'at')
  local l, at = tonumber(v[1]) or cap, tonumber(v[2]) or now
  l = math.min(cap, math.min(cap, l + (now - at) * cap / 60000) + tonumber(ARGV[2]))
  redis.call('HSET', KEYS[1], 'level', tostring(l), 'at', now)
  redis.call('PEXPIRE', KEYS[1], 120000)
end
redis.call('ZREM', KEYS[2], ARGV[3])
return 1
"""


@dataclass
class Taken:
    """What a request took from its tenant's quotas, to settle when it ends."""

    tenant: Tenant
    tokens: int
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)


def _reset(level: float, cap: int) -> str:
    """OpenAI's reset header: seconds until the bucket is full again, as ``1.5s``."""
    seconds = max(0.0, (cap - level) * 60 / cap)
    return f"{seconds:.3g}s"


def rate_headers(limits: TenantLimits, requests: float, tokens: float) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, cap, level in (
        ("requests", limits.requests_per_minute, requests),
        ("tokens", limits.tokens_per_minute, tokens),
    ):
        if cap:
            headers[f"x-ratelimit-limit-{name}"] = str(cap)
            headers[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(level)))
            headers[f"x-ratelimit-reset-{name}"] = _reset(level, cap)
    return headers


def rate_limited(
    tenant: Tenant, which: str, wanted: int, level: float, headers: dict[str, str]
) -> APIError:
    limits = tenant.limits
    if which == "concurrent":
        message = (
            f"Rate limit reached for {tenant.name}: {limits.concurrent_requests} requests in flight"
        )
        retry = 1.0
    elif which == "requests":
        cap = limits.requests_per_minute or 1
        message = f"Rate limit reached for {tenant.name} on requests per min (RPM): Limit {cap}"
        retry = (1 - level) * 60 / cap
    else:
        cap = limits.tokens_per_minute or 1
        if wanted > cap:
            message = (
                f"Request too large for {tenant.name} on tokens per min (TPM): Limit "
                f"{cap}, Requested {wanted}"
            )
            return APIError(429, message, which, code="rate_limit_exceeded", headers=headers)
        message = (
            f"Rate limit reached for {tenant.name} on tokens per min (TPM): Limit {cap}, "
            f"Remaining {max(0, math.floor(level))}, Requested {wanted}"
        )
        retry = (wanted - level) * 60 / cap
    headers = {**headers, "retry-after": str(max(1, math.ceil(retry)))}
    return APIError(429, message, which if which != "concurrent" else "requests",
                    code="rate_limit_exceeded", headers=headers)  # fmt: skip


class Quotas:
    """The tenants' buckets in the index's Redis (``args.index.url``), under ``prefix``."""

    def __init__(self, url: str, prefix: str) -> None:
        # a burst of requests shares a few connections, waiting for one, rather than opening
        # one each (and failing open when the pool says no)
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=8, timeout=1.0, socket_timeout=1.0
        )
        self._redis = redis.asyncio.Redis(connection_pool=pool)
        self._take = self._redis.register_script(TAKE)
        self._settle = self._redis.register_script(SETTLE)
        self.prefix = prefix
        self.unchecked = 0

    def _keys(self, tenant: Tenant) -> list[str]:
        base = f"{self.prefix}:quota:{tenant.name}"
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:inflight"]

    async def take(self, tenant: Tenant, tokens: int) -> Taken | None:
        """Take a request and ``tokens`` from ``tenant``'s quotas, or refuse (429). None: the
        tenant has no limits (or Redis did not answer: it passes, counted)."""
        limits = tenant.limits
        caps = (limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent_requests)
        if not any(caps):
            return None
        request_id = uuid.uuid4().hex
        args = [c or 0 for c in caps] + [tokens, request_id, IN_FLIGHT_TTL_MS]
        try:
            ok, which, requests, level, _ = await self._take(keys=self._keys(tenant), args=args)
        except RedisError as exc:
            self.unchecked += 1
            log.warning("quotas unchecked (%s): %s passes", exc, tenant.name)
            return None
        headers = rate_headers(limits, float(requests), float(level))
        if not ok:
            which = which.decode() if isinstance(which, bytes) else which
            wanted_level = float(requests) if which == "requests" else float(level)
            raise rate_limited(tenant, which, tokens, wanted_level, headers)
        return Taken(tenant, tokens, request_id, headers)

    async def settle(self, taken: Taken, actual_tokens: int) -> None:
        """The request ended: its tokens corrected to ``actual_tokens``, its place freed."""
        cap = taken.tenant.limits.tokens_per_minute or 0
        keys = self._keys(taken.tenant)
        try:
            await self._settle(
                keys=[keys[1], keys[2]], args=[cap, taken.tokens - actual_tokens, taken.request_id]
            )
        except RedisError as exc:
            log.warning("quota settle for %s failed: %s", taken.tenant.name, exc)

    async def close(self) -> None:
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()
