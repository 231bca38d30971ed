"""What a router does with the index: ask what every live replica holds of a prompt and what
is booked there, book its decisions, and release them. Never raises on the request path:
``None`` means "unknown, fall back".

A query walks the prompt's chain block by block (each block's holders in its own set) and
reads the footprints and loads from one hash each, so its cost follows the holders of the
matched blocks, not the number of replicas. After ``TRIP_AFTER_FAILURES`` failed queries
in a row the reader stops asking for ``retry_after_s`` (a circuit breaker); one slow answer
does not trip it (docs/decisions.md says why). The inspection helpers (``live_replicas``,
``replica_stats``) are for operators, experiments and tests.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvindex import keys, scripts
from kvindex.config import IndexConfig
from kvindex.records import Booking, Load, ReplicaState, ReplicaTable, is_store

TRIP_AFTER_FAILURES = 3  # failed queries in a row before routers stop asking for a while


@dataclass
class IndexCounters:
    """Failures seen by one reader; nothing here ever raises into a caller."""

    queries: int = 0
    query_failures: int = 0
    queries_skipped: int = 0  # answered "unknown" without asking, after recent failures
    booking_failures: int = 0  # bookings, prefill-done marks or releases Redis did not take


class IndexReader:
    """A router's client of the index, namespaced by cluster name and model id. The sync
    methods serve the simulator's comparisons, tests and tools; the router uses the async
    ones on its event loop."""

    def __init__(self, config: IndexConfig, model_id: str) -> None:
        self.config = config
        self.namespace = keys.namespace(config.cluster, model_id)
        options = {
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
        }
        self._redis = redis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 0), **options)
        self._aredis = redis.asyncio.Redis.from_url(
            config.url, retry=AsyncRetry(NoBackoff(), 0), **options
        )
        self._query = self._redis.register_script(scripts.QUERY)
        self._unshare = self._redis.register_script(scripts.UNSHARE)
        self._ascripts = {
            name: self._aredis.register_script(src)
            for name, src in (
                ("query", scripts.QUERY),
                ("book", scripts.BOOK),
                ("prefill_done", scripts.PREFILL_DONE),
                ("release", scripts.RELEASE),
                ("share", scripts.SHARE),
            )
        }
        self.counters = IndexCounters()
        self._skip_until = 0.0
        self._failures_in_a_row = 0
        self._lock = threading.Lock()

    def query(self, block_hashes: Sequence[bytes]) -> ReplicaTable | None:
        """For every live replica, what it holds of the chain, its footprint and bookings."""
        if not self._may_ask():
            return None
        try:
            flat = self._query(args=[self.namespace, *block_hashes])
        except redis.RedisError:
            return self._failed()
        return self._answered(flat)

    def cached(self, block_hashes: Sequence[bytes]) -> dict[str, int] | None:
        """For every live replica, how many leading blocks of the chain it has published."""
        answer = self.query(block_hashes)
        return None if answer is None else {s.replica_id: s.cached_blocks or 0 for s in answer}

    async def aquery(self, block_hashes: Sequence[bytes]) -> ReplicaTable | None:
        """``query`` for an event loop (the request router's)."""
        if not self._may_ask():
            return None
        try:
            flat = await self._ascripts["query"](args=[self.namespace, *block_hashes])
        except (redis.RedisError, OSError):
            return self._failed()
        return self._answered(flat)

    async def abook(self, booking: Booking, predict_ttl_s: float, booking_ttl_s: float) -> int:
        """Book a routed request on its replica: the log's sequence number of the booking
        (a mirror includes it once it has applied that event), 0 if Redis did not take it."""
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

    async def ashare(
        self,
        router_id: str,
        ttl_s: float,
        totals: Mapping[str, Load],
        predictions: Sequence[tuple[str, Sequence[bytes]]],
        predict_ttl_s: float,
    ) -> int:
        """A mirroring router's bookings (its totals per replica: prefill tokens, requests,
        decode blocks) and the prompts it sent where since its last share; the log's
        sequence number of the last event, 0 if Redis did not take it."""
        body = ",".join(
            f"{rid}:{v.prefill_tokens}:{v.in_flight}:{v.decode_blocks}"
            for rid, v in totals.items()
            if v != Load()
        )
        args: list[object] = [router_id, int(ttl_s * 1000), body, int(predict_ttl_s * 1000)]
        for rid, hashes in predictions:
            args += [rid, b"".join(hashes)]
        return await self._awrite("share", *args)

    def unshare(self, router_id: str) -> bool:
        """A stopping router's shared bookings leave the index now (False: Redis did not
        answer; they lapse after their TTL instead)."""
        try:
            self._unshare(args=[self.namespace, router_id])
        except (redis.RedisError, OSError):
            return False
        return True

    async def _awrite(self, name: str, *args: object) -> int:
        try:
            reply = await self._ascripts[name](args=[self.namespace, *args])
        except (redis.RedisError, OSError):
            with self._lock:
                self.counters.booking_failures += 1
            return 0
        return max(1, int(reply or 0))

    async def aprefill_done(self, replica_id: str, request_id: str) -> int:
        """A booked request's prompt is computed (its first token came)."""
        return await self._awrite("prefill_done", replica_id, request_id)

    async def arelease(self, replica_id: str, request_id: str) -> int:
        """A booked request is over."""
        return await self._awrite("release", replica_id, request_id)

    def live_replicas(self, stores: bool = False) -> dict[str, str]:
        """Replica id -> epoch, for replicas whose heartbeat is current (with ``stores``,
        the node stores' entries too: ``kvindex.records.store_id``)."""
        registry = self._redis.hgetall(keys.registry(self.namespace))
        registry = {k.decode(): v.decode() for k, v in registry.items()}
        beats_keys = [keys.heartbeat(self.namespace, rid) for rid in registry]
        beats = self._redis.mget(beats_keys) if beats_keys else []
        return {
            rid: epoch
            for (rid, epoch), beat in zip(registry.items(), beats, strict=True)
            if beat is not None and beat.decode() == epoch and (stores or not is_store(rid))
        }

    def replica_stats(self, stores: bool = False) -> dict[str, dict[str, Any]]:
        """The latest stats of every live replica that reports them (``stores``: as in
        ``live_replicas``)."""
        live = list(self.live_replicas(stores))
        stat_keys = [keys.stats(self.namespace, rid) for rid in live]
        values = self._redis.mget(stat_keys) if live else []
        return {rid: json.loads(v) for rid, v in zip(live, values, strict=True) if v is not None}

    def replica_blocks(self, replica_id: str) -> set[bytes]:
        """The hashes the index holds for one replica."""
        return set(self._redis.smembers(keys.replica_blocks(self.namespace, replica_id)))

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._redis.close()

    async def aclose(self) -> None:
        await self._aredis.aclose()

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

    def _answered(self, flat: list) -> ReplicaTable:
        with self._lock:
            self._failures_in_a_row = 0
        return decode_answer(flat)


def decode_answer(flat: list) -> ReplicaTable:
    """QUERY's flat reply: per replica its id, then ``scripts.QUERY_FIELDS`` in order."""
    width = len(scripts.QUERY_FIELDS) + 1
    states = []
    for i in range(0, len(flat), width):
        rid = flat[i].decode()
        values = (int(v) for v in flat[i + 1 : i + width])
        states.append(ReplicaState(rid, **dict(zip(scripts.QUERY_FIELDS, values, strict=True))))
    return ReplicaTable.of(states)
