"""The Redis index of published block hashes: which replica holds which block.

Advisory only: a stale entry costs a cache miss, never a wrong answer, because every engine
verifies its hits locally. Key layout (``{ns}`` = ``{ps:<cluster>:<model>}``, a hash tag, so
all keys of a namespace share one slot; two clusters or models never share a key)::

    {ns}:replicas          HASH   replica id -> epoch of its current engine
    {ns}:hb:<replica>      STRING epoch, with a TTL: the replica is live while this exists
                                  and equals its registered epoch
    {ns}:b:<hash>          SET    replica ids holding the block (hash = 16 raw bytes)
    {ns}:r:<replica>       SET    block hashes the replica holds (to purge without a scan)
    {ns}:stats:<replica>   STRING the replica's engine counters (JSON), refreshed with the
                                  heartbeat, for experiments and operators

Only hashes are stored, never tokens or text; with a cluster secret the hashes themselves are
keyed (``router.hashing``), so reading Redis does not tell whether a guessed prompt is cached.

Every operation is one round trip (one Lua script), and every script that writes a replica's
blocks first checks the caller's epoch, so a replica that was replaced (a new epoch) cannot
write stale entries. Failures never raise out of the query path: ``query`` returns None
("unknown") and stops asking Redis for ``retry_after_s`` after a failure (a circuit breaker).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.config import IndexConfig

# Shared by the scripts: drop every block of replica ARGV[1]; KEYS[1] = its block set.
_PURGE = """
local function purge(ns, rid)
  local rkey = ns .. ':r:' .. rid
  local blocks = redis.call('SMEMBERS', rkey)
  for _, h in ipairs(blocks) do redis.call('SREM', ns .. ':b:' .. h, rid) end
  redis.call('DEL', rkey, ns .. ':stats:' .. rid)
  return #blocks
end
"""

# KEYS: none (all keys derive from ARGV[1] = ns). ARGV: ns, rid, epoch, ttl_ms.
_REGISTER = (
    _PURGE
    + """
local ns, rid, epoch = ARGV[1], ARGV[2], ARGV[3]
local old = redis.call('HGET', ns .. ':replicas', rid)
local purged = 0
if old ~= epoch then purged = purge(ns, rid) end
redis.call('HSET', ns .. ':replicas', rid, epoch)
redis.call('SET', ns .. ':hb:' .. rid, epoch, 'PX', ARGV[4])
return purged
"""
)

# ARGV: ns, rid, epoch. Purges and forgets the replica if the epoch is still its own.
_DEREGISTER = (
    _PURGE
    + """
local ns, rid = ARGV[1], ARGV[2]
if redis.call('HGET', ns .. ':replicas', rid) ~= ARGV[3] then return -1 end
local n = purge(ns, rid)
redis.call('HDEL', ns .. ':replicas', rid)
redis.call('DEL', ns .. ':hb:' .. rid)
return n
"""
)

# ARGV: ns, rid, epoch, ttl_ms, stats json ('' for none). 1 = refreshed, 0 = not
# registered with this epoch.
_HEARTBEAT = """
local ns, rid, epoch = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', ns .. ':replicas', rid) ~= epoch then return 0 end
redis.call('SET', ns .. ':hb:' .. rid, epoch, 'PX', ARGV[4])
if ARGV[5] ~= '' then redis.call('SET', ns .. ':stats:' .. rid, ARGV[5], 'PX', ARGV[4]) end
return 1
"""

# ARGV: ns, rid, epoch, replace (0/1), n_stored, stored..., removed...
# replace = 1 makes the stored hashes the replica's whole set (a resync).
_PUBLISH = (
    _PURGE
    + """
local ns, rid, epoch = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', ns .. ':replicas', rid) ~= epoch then return -1 end
if ARGV[4] == '1' then purge(ns, rid) end
local n_stored = tonumber(ARGV[5])
local rkey = ns .. ':r:' .. rid
for i = 6, 5 + n_stored do
  redis.call('SADD', ns .. ':b:' .. ARGV[i], rid)
  redis.call('SADD', rkey, ARGV[i])
end
for i = 6 + n_stored, #ARGV do
  redis.call('SREM', ns .. ':b:' .. ARGV[i], rid)
  redis.call('SREM', rkey, ARGV[i])
end
return redis.call('SCARD', rkey)
"""
)

# ARGV: ns, hashes... Returns {rid, length, ...} for every live replica, where length is the
# number of leading hashes it holds (stopping at its first miss). Each replica's own block set
# is probed with SMISMEMBER in chunks that grow, so a short match costs one small call.
_QUERY = """
local ns = ARGV[1]
local n = #ARGV - 1
local reg = redis.call('HGETALL', ns .. ':replicas')
local flat = {}
for i = 1, #reg, 2 do
  local rid = reg[i]
  if redis.call('GET', ns .. ':hb:' .. rid) == reg[i + 1] then
    local rkey, held, first, size = ns .. ':r:' .. rid, 0, 1, 8
    while first <= n do
      local last = math.min(first + size - 1, n)
      local found = redis.call('SMISMEMBER', rkey, unpack(ARGV, first + 1, last + 1))
      local run = 0
      while run < #found and found[run + 1] == 1 do run = run + 1 end
      held = held + run
      if run < #found then break end
      first, size = last + 1, math.min(size * 4, 1024)
    end
    flat[#flat + 1] = rid
    flat[#flat + 1] = held
  end
end
return flat
"""

# ARGV: ns. Purges and forgets every registered replica whose heartbeat has expired.
_REAP = (
    _PURGE
    + """
local ns = ARGV[1]
local reg = redis.call('HGETALL', ns .. ':replicas')
local reaped = 0
for i = 1, #reg, 2 do
  if redis.call('GET', ns .. ':hb:' .. reg[i]) ~= reg[i + 1] then
    purge(ns, reg[i])
    redis.call('HDEL', ns .. ':replicas', reg[i])
    reaped = reaped + 1
  end
end
return reaped
"""
)


class StaleEpochError(RuntimeError):
    """The replica is no longer registered with this epoch (replaced, or Redis lost it)."""


@dataclass
class IndexCounters:
    """Failures seen by one index client; nothing here ever raises into a caller's step."""

    queries: int = 0
    query_failures: int = 0
    queries_skipped: int = 0  # answered "unknown" without asking, after a recent failure


class BlockIndex:
    """One client of the index, namespaced by cluster name and model id."""

    def __init__(self, config: IndexConfig, model_id: str) -> None:
        self.config = config
        self.namespace = f"{{ps:{config.cluster}:{model_id}}}"
        options = {
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
        }
        # no retries: a failure must cost one timeout, and the caller knows what to do next
        self._redis = redis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 0), **options)
        self._aredis = redis.asyncio.Redis.from_url(
            config.url, retry=AsyncRetry(NoBackoff(), 0), **options
        )
        self._scripts = {
            name: self._redis.register_script(src)
            for name, src in (
                ("register", _REGISTER),
                ("deregister", _DEREGISTER),
                ("heartbeat", _HEARTBEAT),
                ("publish", _PUBLISH),
                ("query", _QUERY),
                ("reap", _REAP),
            )
        }
        self._aquery = self._aredis.register_script(_QUERY)
        self.counters = IndexCounters()
        self._skip_until = 0.0
        self._lock = threading.Lock()

    # -- replica side (raise redis errors; the publisher decides what to do) ------------------

    def register(self, replica_id: str, epoch: str) -> int:
        """Register (or re-register) a replica; a different old epoch's entries are purged."""
        return int(self._run("register", replica_id, epoch, self._ttl_ms()))

    def deregister(self, replica_id: str, epoch: str) -> None:
        """Purge a replica's entries and forget it (only if ``epoch`` is still its own)."""
        self._run("deregister", replica_id, epoch)

    def heartbeat(self, replica_id: str, epoch: str, stats: dict[str, Any] | None = None) -> bool:
        """Refresh liveness (and the replica's stats); False if the replica is not
        registered with this epoch."""
        payload = json.dumps(stats) if stats is not None else ""
        return bool(self._run("heartbeat", replica_id, epoch, self._ttl_ms(), payload))

    def publish(
        self,
        replica_id: str,
        epoch: str,
        stored: Iterable[bytes],
        removed: Iterable[bytes] = (),
        replace: bool = False,
    ) -> int:
        """Apply one batch in one round trip; ``replace`` makes ``stored`` the whole set.

        Returns how many blocks the index now holds for the replica. Raises
        ``StaleEpochError`` if the replica is not registered with ``epoch``.
        """
        stored, removed = list(stored), list(removed)
        args = (int(replace), len(stored), *stored, *removed)
        n = int(self._run("publish", replica_id, epoch, *args))
        if n < 0:
            raise StaleEpochError(f"{replica_id} is not registered with epoch {epoch}")
        return n

    def reap(self) -> int:
        """Purge every replica whose heartbeat expired; returns how many were purged."""
        return int(self._run("reap"))

    def replica_blocks(self, replica_id: str) -> set[bytes]:
        return set(self._redis.smembers(f"{self.namespace}:r:{replica_id}"))

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """The latest stats of every live replica that reports them."""
        live = list(self.live_replicas())
        values = self._redis.mget([f"{self.namespace}:stats:{rid}" for rid in live]) if live else []
        return {rid: json.loads(v) for rid, v in zip(live, values, strict=True) if v is not None}

    def live_replicas(self) -> dict[str, str]:
        """Replica id -> epoch, for replicas whose heartbeat is current."""
        registry = {k.decode(): v.decode() for k, v in self._registry().items()}
        keys = [f"{self.namespace}:hb:{rid}" for rid in registry]
        beats = self._redis.mget(keys) if keys else []
        return {
            rid: epoch
            for (rid, epoch), beat in zip(registry.items(), beats, strict=True)
            if beat is not None and beat.decode() == epoch
        }

    # -- router side (never raise: None means "unknown, fall back") ---------------------------

    def query(self, block_hashes: Sequence[bytes]) -> dict[str, int] | None:
        """For every live replica, how many leading blocks of the chain it holds."""
        if not self._may_ask():
            return None
        try:
            flat = self._scripts["query"](args=[self.namespace, *block_hashes])
        except redis.RedisError:
            return self._failed()
        return _pairs(flat)

    async def aquery(self, block_hashes: Sequence[bytes]) -> dict[str, int] | None:
        """``query`` for an event loop (the request router's)."""
        if not self._may_ask():
            return None
        try:
            flat = await self._aquery(args=[self.namespace, *block_hashes])
        except (redis.RedisError, OSError):
            return self._failed()
        return _pairs(flat)

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._redis.close()

    async def aclose(self) -> None:
        await self._aredis.aclose()

    # -- internals ----------------------------------------------------------------------------

    def _run(self, name: str, *args: object) -> object:
        return self._scripts[name](args=[self.namespace, *args])

    def _registry(self) -> dict[bytes, bytes]:
        return self._redis.hgetall(f"{self.namespace}:replicas")

    def _ttl_ms(self) -> int:
        return int(self.config.heartbeat_ttl_s * 1000)

    def _may_ask(self) -> bool:
        with self._lock:
            self.counters.queries += 1
            if time.monotonic() < self._skip_until:
                self.counters.queries_skipped += 1
                return False
            return True

    def _failed(self) -> None:
        with self._lock:
            self.counters.query_failures += 1
            self._skip_until = time.monotonic() + self.config.retry_after_s
        return None


def _pairs(flat: list) -> dict[str, int]:
    return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}
