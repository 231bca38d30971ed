"""Feeds one engine's cache events to the Redis index without ever blocking an engine step."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from kvindex.writer import IndexWriter, StaleEpochError
from replica.engine.blocks.prefix_cache import CacheEvents

log = logging.getLogger(__name__)

_REAP_EVERY = 10  # heartbeats between sweeps for replicas whose heartbeat expired


@dataclass
class PublisherCounters:
    batches: int = 0  # publish round trips that succeeded
    resyncs: int = 0  # full-set replacements that succeeded
    failures: int = 0  # Redis errors or timeouts, of any operation
    dropped_batches: int = 0  # batches lost to a failure (repaired by a resync)
    overflows: int = 0  # unsent changes exceeded max_pending_hashes (repaired by a resync)
    registrations: int = 0
    heartbeats: int = 0  # heartbeats Redis took

    def routing_stats(self, in_sync: bool) -> dict[str, int | bool]:
        """What a replica reports of its feed of the index (the routers' gauges
        ``prefix_serve_replica_index_*``): whether it is in sync, and what it lost."""
        return {
            "index_in_sync": in_sync,
            "index_failures": self.failures,
            "index_resyncs": self.resyncs,
            "index_dropped_batches": self.dropped_batches,
            "index_overflows": self.overflows,
        }


class IndexPublisher:
    """Keeps the index's view of one replica equal to its engine's cached set.

    The engine's thread calls ``on_events`` (a few set and dict updates under a lock; no I/O).
    A background thread sends what accumulated as one batch per round trip, heartbeats, and
    registers the replica. Events cannot be lost between engine and publisher (they are
    handed over in process), only between publisher and Redis; so the publisher mirrors the
    engine's cached set, and after any failure, a restart of Redis, or a registration it
    replaces the replica's whole entry with the mirror (a resync). The index converges to the
    engine's truth once Redis answers again.
    """

    def __init__(
        self,
        index: IndexWriter,
        replica_id: str,
        cached: Iterable[bytes] = (),
        epoch: str | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.index = index
        self.replica_id = replica_id
        self.stats = stats  # sent with each heartbeat; called on the publisher thread
        self.epoch = epoch or uuid.uuid4().hex  # a new epoch on every engine start
        self.counters = PublisherCounters()
        self._mirror = set(cached)
        self._pending: dict[bytes, bool] = {}  # hash -> held, not yet sent
        self._registered = False
        self._resync = True
        self._in_flight = False
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"index-publisher-{replica_id}", daemon=True
        )

    def start(self) -> IndexPublisher:
        self._thread.start()
        return self

    def on_events(self, events: CacheEvents) -> None:
        """Engine listener: record a step's changes for the next batch."""
        with self._cond:
            if events.cleared:
                self._mirror.clear()
                self._pending.clear()
                self._resync = True
            self._mirror.difference_update(events.removed)
            self._mirror.update(events.stored)
            if not self._resync:
                self._pending.update(dict.fromkeys(events.removed, False))
                self._pending.update(dict.fromkeys(events.stored, True))
                if len(self._pending) > self.index.config.max_pending_hashes:
                    self.counters.overflows += 1
                    self._pending.clear()
                    self._resync = True
            self._cond.notify()

    @property
    def in_sync(self) -> bool:
        """Registered, and everything the engine did has reached Redis."""
        with self._cond:
            return self._synced()

    def wait_in_sync(self, timeout_s: float) -> bool:
        """Block until ``in_sync`` (tests and benchmarks), or give up after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(self._synced, timeout_s)

    def close(self, deregister: bool = True) -> None:
        """Stop the thread; by default also purge this replica from the index (best effort)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if deregister:
            try:
                self.index.deregister(self.replica_id, self.epoch)
            except redis.RedisError:
                log.warning("could not deregister %s from the index", self.replica_id)

    def _run(self) -> None:
        cfg = self.index.config
        beats = 0
        next_beat = 0.0
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closing or self._resync or bool(self._pending),
                    timeout=cfg.heartbeat_interval_s,
                )
                if self._closing:
                    return
            try:
                self._send_once()
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + cfg.heartbeat_interval_s
                    self._heartbeat()
                    beats += 1
                    if beats % _REAP_EVERY == 0:
                        # one reap per TTL for the whole cluster, whoever gets there first
                        self.index.reap(min_interval_s=cfg.heartbeat_ttl_s)
            except redis.RedisError as exc:
                with self._cond:
                    self.counters.failures += 1
                    if self._in_flight:
                        self.counters.dropped_batches += 1
                    self._in_flight = False
                    self._pending.clear()
                    self._resync = True
                    self._cond.notify_all()
                    log.debug("index unavailable (%s); will resync", exc)
                    self._cond.wait_for(lambda: self._closing, cfg.retry_after_s)

    def _send_once(self) -> None:
        """Register if needed, then send either a full resync or the pending changes."""
        if not self._registered:
            self.index.register(self.replica_id, self.epoch)
            with self._cond:
                self._registered = True
                self._resync = True
                self.counters.registrations += 1
        with self._cond:
            replace = self._resync
            if replace:
                stored, removed = list(self._mirror), []
                self._resync = False
            else:
                stored = [h for h, held in self._pending.items() if held]
                removed = [h for h, held in self._pending.items() if not held]
            self._pending.clear()
            if not (replace or stored or removed):
                return
            self._in_flight = True
        try:
            self.index.publish(self.replica_id, self.epoch, stored, removed, replace=replace)
        except StaleEpochError:
            with self._cond:
                self._registered = False
                self._resync = True
                self._in_flight = False
            return
        with self._cond:
            self._in_flight = False
            if replace:
                self.counters.resyncs += 1
            else:
                self.counters.batches += 1
            self._cond.notify_all()

    def _synced(self) -> bool:
        return self._registered and not (self._resync or self._pending or self._in_flight)

    def _heartbeat(self) -> None:
        stats = None
        if self.stats is not None:
            try:
                stats = self.stats()
            except Exception:  # stats are a courtesy; liveness must not depend on them
                log.exception("replica stats failed")
        beat = self.index.heartbeat(self.replica_id, self.epoch, stats)
        self.counters.heartbeats += 1
        if not beat:
            # Redis lost us (restarted empty) or reaped us: register again and resync.
            with self._cond:
                self._registered = False
                self._resync = True
