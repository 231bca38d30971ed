"""The Redis index of published block hashes: which replica holds which block.

Advisory only: a stale entry costs a cache miss, never a wrong answer, because every engine
verifies its hits locally. Key layout (``{ns}`` = ``{ps:<cluster>:<model>}``, a hash tag, so
all keys of a namespace share one slot; two clusters or models never share a key)::

    {ns}:replicas          HASH   replica id -> epoch of its current engine
    {ns}:hb:<replica>      STRING epoch, with a TTL: the replica is live while this exists
                                  and equals its registered epoch
    {ns}:b:<hash>          SET    replica ids holding the block (hash = 16 raw bytes)
    {ns}:r:<replica>       SET    block hashes the replica holds (to purge without a scan)
    {ns}:fp                HASH   replica id -> how many blocks it holds (its footprint)
    {ns}:stats:<replica>   STRING the replica's engine counters (JSON), refreshed with the
                                  heartbeat, for experiments and operators
    {ns}:pb:<hash>         ZSET   replica ids routers recently sent the block to (predicted
                                  to hold it soon) -> expiry (ms, Redis clock)
    {ns}:pr:<replica>      ZSET   the same predictions by replica (for a purge to find them)
    {ns}:bk:<replica>      ZSET   requests routed there and not finished -> expiry
    {ns}:bt:<replica>      HASH   request -> "prefill tokens:decode blocks" it was booked with
    {ns}:loads             HASH   "<replica>:prefill" / ":active" / ":decode": the sums of
                                  each replica's bookings
    {ns}:reaping           STRING set while one caller reaps expired replicas

Routers book every request they route (``book``), mark its prompt computed at its first
token (``prefill_done``) and release it when it ends (``release``), so every ingress sees the
same, current load; a booking whose release was lost expires. Predicted blocks let the
followers of a new prompt find it before the replica has published anything.

Only hashes are stored, never tokens or text; with a cluster secret the hashes themselves are
keyed (``kvindex.hashing``), so reading Redis does not tell whether a guessed prompt is cached.

Longer than 300 lines because the key layout above is one contract: the replica's writes
(register, publish, heartbeat, purge) and the routers' reads and bookings are kept side by
side so a change to a key is made in both at once (the Lua itself is in ``index_scripts``).

Every operation is one round trip (one Lua script), and every script that writes a replica's
blocks first checks the caller's epoch, so a replica that was replaced (a new epoch) cannot
write stale entries. A query walks the prompt's chain block by block (each block's holders
in its own set) and reads the footprints and loads from one hash each, so its cost follows
the holders of the matched blocks, not the number of replicas. Failures never raise out of
the query path: ``query`` returns None ("unknown"), and after ``TRIP_AFTER_FAILURES`` in
a row stops asking Redis for ``retry_after_s`` (a circuit breaker). One slow answer does
not trip it: on a 2-core machine a CPU-starved ingress sees an occasional read pass its
timeout, and a breaker that tripped on it routed the next second of requests blind.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import redis
import redis.asyncio
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvindex import scripts
from kvindex.records import Booking, ReplicaView

TRIP_AFTER_FAILURES = 3  # failed queries in a row before routers stop asking for a while


class IndexConfig(BaseModel):
    """Where the Redis block index lives and how long anyone waits for it.

    ``cluster`` and the model id namespace every key, so several clusters (or models) can
    share one Redis. Reads (``timeout_s``) are bounded: the index is advisory, and a slow
    Redis must not stall routing for long. The bound is 250 ms, not a few: an answer is a
    millisecond of Redis time, but the router shares its process with the ingress, and on a
    saturated 2-core machine a 50 ms bound expired on ~20% of queries at 4 requests/s (the
    answer was there; the router's thread had not run), each one a decision without cache
    knowledge. A replica's own writes (register,
    publish, heartbeat) run on its publisher thread, off every request's path, so they wait
    longer (``write_timeout_s``): on a saturated machine a 50 ms bound failed them again and
    again, the heartbeat lapsed, and routers dropped a live replica (and its cache).
    """

    model_config = ConfigDict(extra="forbid")

    url: str = "redis://127.0.0.1:6379/0"
    cluster: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$")
    heartbeat_ttl_s: float = Field(3.0, gt=0)
    heartbeat_interval_s: float = Field(0.5, gt=0)
    timeout_s: float = Field(0.25, gt=0, description="per Redis read (routing)")
    write_timeout_s: float = Field(
        1.0, gt=0, description="per replica write (publisher thread: register, publish, beat)"
    )
    connect_timeout_s: float = Field(0.25, gt=0)
    retry_after_s: float = Field(1.0, ge=0, description="pause after a failure before retrying")
    max_pending_hashes: int = Field(
        65_536, gt=0, description="unsent changes kept before falling back to a resync"
    )


class StaleEpochError(RuntimeError):
    """The replica is no longer registered with this epoch (replaced, or Redis lost it)."""


@dataclass
class IndexCounters:
    """Failures seen by one index client; nothing here ever raises into a caller's step."""

    queries: int = 0
    query_failures: int = 0
    queries_skipped: int = 0  # answered "unknown" without asking, after a recent failure
    booking_failures: int = 0  # bookings, prefill-done marks or releases Redis did not take


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
        self._writer = redis.Redis.from_url(
            config.url,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=config.write_timeout_s,
            socket_connect_timeout=config.write_timeout_s,
        )
        self._aredis = redis.asyncio.Redis.from_url(
            config.url, retry=AsyncRetry(NoBackoff(), 0), **options
        )
        self._query = self._redis.register_script(scripts.QUERY)
        self._scripts = {
            name: self._writer.register_script(src)
            for name, src in (
                ("register", scripts.REGISTER),
                ("deregister", scripts.DEREGISTER),
                ("heartbeat", scripts.HEARTBEAT),
                ("publish", scripts.PUBLISH),
                ("reap", scripts.REAP),
            )
        }
        self._ascripts = {
            name: self._aredis.register_script(src)
            for name, src in (
                ("query", scripts.QUERY),
                ("book", scripts.BOOK),
                ("prefill_done", scripts.PREFILL_DONE),
                ("release", scripts.RELEASE),
            )
        }
        self.counters = IndexCounters()
        self._skip_until = 0.0
        self._failures_in_a_row = 0
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

    def reap(self, min_interval_s: float = 0.0) -> int:
        """Purge every replica whose heartbeat expired; returns how many were purged (-1:
        another caller reaped less than ``min_interval_s`` ago, so this one did nothing)."""
        return int(self._run("reap", int(min_interval_s * 1000)))

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

    def query(self, block_hashes: Sequence[bytes]) -> dict[str, ReplicaView] | None:
        """For every live replica, what it holds of the chain, its footprint and bookings."""
        if not self._may_ask():
            return None
        try:
            flat = self._query(args=[self.namespace, *block_hashes])
        except redis.RedisError:
            return self._failed()
        return self._answered(flat)

    def held(self, block_hashes: Sequence[bytes]) -> dict[str, int] | None:
        """For every live replica, how many leading blocks of the chain it has published."""
        views = self.query(block_hashes)
        return None if views is None else {rid: v.held_blocks for rid, v in views.items()}

    async def aquery(self, block_hashes: Sequence[bytes]) -> dict[str, ReplicaView] | None:
        """``query`` for an event loop (the request router's)."""
        if not self._may_ask():
            return None
        try:
            flat = await self._ascripts["query"](args=[self.namespace, *block_hashes])
        except (redis.RedisError, OSError):
            return self._failed()
        return self._answered(flat)

    async def abook(self, booking: Booking, predict_ttl_s: float, booking_ttl_s: float) -> bool:
        """Book a routed request on its replica; False if Redis did not take it."""
        args = (
            booking.replica_id,
            booking.request_id,
            booking.prefill_tokens,
            booking.decode_blocks,
            int(booking_ttl_s * 1000),
            int(predict_ttl_s * 1000),
            *booking.block_hashes,
        )
        return await self._awrite("book", *args)

    async def aprefill_done(self, replica_id: str, request_id: str) -> bool:
        """A booked request's prompt is computed (its first token came)."""
        return await self._awrite("prefill_done", replica_id, request_id)

    async def arelease(self, replica_id: str, request_id: str) -> bool:
        """A booked request is over."""
        return await self._awrite("release", replica_id, request_id)

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._redis.close()
        self._writer.close()

    # -- internals ----------------------------------------------------------------------------

    def _run(self, name: str, *args: object) -> object:
        return self._scripts[name](args=[self.namespace, *args])

    async def _awrite(self, name: str, *args: object) -> bool:
        try:
            await self._ascripts[name](args=[self.namespace, *args])
        except (redis.RedisError, OSError):
            with self._lock:
                self.counters.booking_failures += 1
            return False
        return True

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
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= TRIP_AFTER_FAILURES:
                self._skip_until = time.monotonic() + self.config.retry_after_s
                self._failures_in_a_row = 0
        return None

    def _answered(self, flat: list) -> dict[str, ReplicaView]:
        with self._lock:
            self._failures_in_a_row = 0
        return _views(flat)


def _views(flat: list) -> dict[str, ReplicaView]:
    width = len(fields(ReplicaView)) + 1
    return {
        flat[i].decode(): ReplicaView(*(int(v) for v in flat[i + 1 : i + width]))
        for i in range(0, len(flat), width)
    }
