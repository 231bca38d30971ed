"""A router's live copy of the index, so a routing decision never waits on Redis.

Redis stays the index's home: replicas publish into it as before, and every script that
changes what a query would answer also appends an event to the namespace's log (a stream,
``kvindex.lua.EMIT``; entry ids are sequence numbers). A mirror loads a snapshot (the
registry and loads at one instant, then each replica's blocks), follows the log from the
snapshot's sequence number, and answers ``query`` from memory with what ``IndexReader.query``
would answer from Redis on the same state: a test holds the two equal.

It resyncs (a new snapshot) when the log jumps (it fell behind the log's trimming), when
the log's name changes (Redis restarted, empty or rebuilt) or its sequence number goes back,
and when it cannot reach Redis for long enough that events may be gone. Liveness is not
logged (heartbeats expire): the follower polls the live set every ``live_poll_s`` (one
script, O(replicas)). While it has not synced, or has not heard from Redis for
``stale_after_s``, ``query`` answers None ("unknown": the router falls back as it does when
Redis does not answer).

Predicted blocks (routers' bookings) come in the snapshot from each registered replica's
list of its predictions (``{ns}:pr:<replica>``, with their expiry), then from the log.
Memory: one dict entry per distinct block (its holders as a bitmask over
replica slots) and one set entry per (replica, block), measured by ``bench index``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvindex import keys, scripts
from kvindex.background import Background
from kvindex.config import IndexConfig
from kvindex.mirror.state import MirrorState
from kvindex.records import ReplicaTable

SNAPSHOT_CHUNK = 32  # replicas whose blocks one round trip of a snapshot reads


@dataclass
class MirrorCounters:
    events: int = 0
    resyncs: int = 0  # snapshots taken (the first included)
    gaps: int = 0  # resyncs because the log jumped past what this mirror had read
    restarts: int = 0  # resyncs because the log's name changed or went back (Redis restart)
    failures: int = 0  # Redis errors met while following
    unknown_answers: int = 0  # queries answered None (not synced, or stale)


class IndexMirror(Background):
    """Follows one namespace's log on a thread of its own; ``query`` is thread-safe."""

    thread_name = "index-mirror"

    def __init__(
        self,
        config: IndexConfig,
        model_id: str,
        block_ms: int = 50,
        router_id: str | None = None,
        live_poll_s: float | None = None,
        stale_after_s: float | None = None,
    ) -> None:
        super().__init__()
        self.namespace = keys.namespace(config.cluster, model_id)
        self._log = f"{self.namespace}:ev"
        self._redis = redis.Redis.from_url(
            config.url,
            retry=Retry(NoBackoff(), 0),
            # off every request's path: it may wait as long as a replica's writes do
            socket_timeout=max(config.timeout_s, config.write_timeout_s) + block_ms / 1000,
            socket_connect_timeout=config.connect_timeout_s,
        )
        self._snapshot = self._redis.register_script(scripts.SNAPSHOT)
        self._live_now = self._redis.register_script(scripts.LIVE_NOW)
        self.block_ms = block_ms
        self.live_poll_s = config.heartbeat_interval_s if live_poll_s is None else live_poll_s
        self.stale_after_s = config.heartbeat_ttl_s if stale_after_s is None else stale_after_s
        self.counters = MirrorCounters()
        self.router_id = router_id  # its own shared bookings are left out of its answers
        self.state = MirrorState(router_id)
        self._lock = threading.Lock()
        self._log_id: str | None = None  # None: not synced
        self._live_known = False
        self.synced_at: float | None = None  # wall clock of the last snapshot's first sync
        self._heard = 0.0  # monotonic time of the last answer from Redis
        self._next_live = 0.0
        self._clock_offset_ms = 0.0

    @property
    def seq(self) -> int:
        """The last event applied."""
        return self.state.seq

    def stop(self) -> None:
        self._halt()
        self._redis.close()

    def synced(self) -> bool:
        fresh = time.monotonic() - self._heard < self.stale_after_s
        return self._log_id is not None and self._live_known and fresh

    def query(self, block_hashes: Sequence[bytes]) -> ReplicaTable | None:
        """``IndexReader.query``'s answer, from memory; None while not synced or stale."""
        if not self.synced():
            self.counters.unknown_answers += 1
            return None
        with self._lock:
            return self.state.answer(block_hashes, self._redis_now_ms())

    def predict(self, replica_id: str, block_hashes: Sequence[bytes], ttl_s: float) -> None:
        """This router just sent a prompt there: its own next decisions see the prediction
        at once (the other routers when its share arrives; the same event then lands here
        too, with the same effect)."""
        with self._lock:
            self.state.predict(replica_id, self._redis_now_ms() + ttl_s * 1000, block_hashes)

    def _redis_now_ms(self) -> float:
        return time.time() * 1000 + self._clock_offset_ms

    def wait_for(self, seq: int, timeout_s: float = 5.0) -> bool:
        """Block until the event ``seq`` is applied (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while self.state.seq < seq or not self.synced():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def step(self) -> int:
        """One round of following: resync if needed, poll liveness when due, apply the
        events that came (waiting up to ``block_ms``). Returns the events applied."""
        if self._log_id is None:
            self.resync()
        if time.monotonic() >= self._next_live:
            self._poll_live()
        return self._follow()

    def resync(self) -> None:
        """A fresh snapshot, swapped in whole."""
        log_id, seq, registry, loads, shares = self._snapshot(args=[self.namespace])
        registry = _pairs(registry)
        fresh = MirrorState(self.router_id)
        fresh.seq = int(seq)
        rids = list(registry)
        fresh.reserve(self._count_blocks(rids))  # one table for the whole snapshot
        for first in range(0, len(rids), SNAPSHOT_CHUNK):  # bounded replies, each in time
            chunk = rids[first : first + SNAPSHOT_CHUNK]
            pipe = self._redis.pipeline(transaction=False)
            for rid in chunk:
                pipe.smembers(f"{self.namespace}:r:{rid}")
                pipe.zrange(f"{self.namespace}:pr:{rid}", 0, -1, withscores=True)
            replies = pipe.execute()
            for i, rid in enumerate(chunk):
                fresh.register(rid, registry[rid])
                fresh.add(rid, replies[2 * i])
                for block, expiry in replies[2 * i + 1]:  # a prediction expires by its score
                    fresh.predict(rid, expiry, [block])
        for field, value in _pairs(loads).items():
            rid, _, name = field.rpartition(":")
            fresh.set_load_field(rid, name, int(value))
        for router, payload in _pairs(shares).items():
            fresh.share(router, payload.encode())
        with self._lock:
            self.state = fresh
            self._log_id = _text(log_id)
            self._live_known = False  # synced once the live set is polled (next)
        self._heard = time.monotonic()
        self._next_live = 0.0
        self.counters.resyncs += 1

    def _count_blocks(self, rids: list[str]) -> int:
        pipe = self._redis.pipeline(transaction=False)
        for rid in rids:
            pipe.scard(f"{self.namespace}:r:{rid}")
        return sum(pipe.execute()) if rids else 0

    def _poll_live(self) -> None:
        sent = time.time() * 1000
        log_id, seq, live, (secs, usecs) = self._live_now(args=[self.namespace])
        if self._log_id == "" and int(seq) >= self.state.seq:
            self._log_id = _text(log_id)  # the log had no name at the snapshot: its first event
        if _text(log_id) != self._log_id or int(seq) < self.state.seq:
            self.counters.restarts += 1
            self.resync()
            return
        # predictions expire by Redis's clock: how far ahead of ours it is (half the trip)
        redis_ms = int(secs) * 1000 + int(usecs) / 1000
        self._clock_offset_ms = redis_ms - (sent + time.time() * 1000) / 2
        with self._lock:
            if not self._live_known:  # synced from now on: when (fault reports time it)
                self.synced_at = time.time()
            self._live_known = True
            self.state.set_live([_text(r) for r in live])
            now_ms = redis_ms  # what expires, expires by Redis's clock
            self.state.expire_shares(now_ms)
            self.state.expire_predictions(now_ms)
        self._heard = time.monotonic()
        self._next_live = self._heard + self.live_poll_s

    def _follow(self) -> int:
        start = f"0-{self.state.seq}"
        reply = self._redis.xread({self._log: start}, count=10_000, block=self.block_ms)
        self._heard = time.monotonic()
        entries = reply[0][1] if reply else []
        if not entries:
            return 0
        first = int(_text(entries[0][0]).split("-")[1])
        if first != self.state.seq + 1:
            self.counters.gaps += 1
            self.resync()
            return 0
        with self._lock:
            for entry_id, fields in entries:
                self.state.apply(fields)
                self.state.seq = int(_text(entry_id).split("-")[1])
        self.counters.events += len(entries)
        return len(entries)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except (redis.RedisError, OSError):
                self.counters.failures += 1
                if time.monotonic() - self._heard > self.stale_after_s:
                    self._log_id = None  # events may have been missed: start over
                self._stop.wait(0.1)


def _pairs(flat: list) -> dict[str, str]:
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
