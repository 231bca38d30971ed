"""What a replica does to the index: register, publish its cached blocks, heartbeat, reap the
dead, deregister. Synchronous, on the replica's publisher thread; Redis errors are raised
(the publisher decides what to do next).

Every operation is one round trip (one Lua script), and every script that writes a replica's
blocks first checks the caller's epoch, so a replica that was replaced (a new epoch) cannot
write stale entries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvindex import keys, scripts
from kvindex.config import IndexConfig


class StaleEpochError(RuntimeError):
    """The replica is no longer registered with this epoch (replaced, or Redis lost it)."""


class IndexWriter:
    """One replica's client of the index, namespaced by cluster name and model id."""

    def __init__(self, config: IndexConfig, model_id: str) -> None:
        self.config = config
        self.namespace = keys.namespace(config.cluster, model_id)
        # no retries: a failure costs one timeout, and the publisher knows what to do next
        self._redis = redis.Redis.from_url(
            config.url,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=config.write_timeout_s,
            socket_connect_timeout=config.write_timeout_s,
        )
        self._scripts = {
            name: self._redis.register_script(src)
            for name, src in (
                ("register", scripts.REGISTER),
                ("deregister", scripts.DEREGISTER),
                ("heartbeat", scripts.HEARTBEAT),
                ("publish", scripts.PUBLISH),
                ("reap", scripts.REAP),
            )
        }

    def register(self, replica_id: str, epoch: str) -> int:
        """Register (or re-register) a replica; a different old epoch's entries are purged."""
        return int(self._run("register", replica_id, epoch, self._ttl_ms()))

    def deregister(self, replica_id: str, epoch: str) -> None:
        """Purge a replica's entries and forget it (only if ``epoch`` is still its own)."""
        self._run("deregister", replica_id, epoch)

    def registered_epoch(self, replica_id: str) -> str | None:
        """The epoch the registry holds for ``replica_id`` (None: not registered)."""
        epoch = self._redis.hget(keys.registry(self.namespace), replica_id)
        return None if epoch is None else epoch.decode()

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

    def close(self) -> None:
        self._redis.close()

    def _run(self, name: str, *args: object) -> object:
        return self._scripts[name](args=[self.namespace, *args])

    def _ttl_ms(self) -> int:
        return int(self.config.heartbeat_ttl_s * 1000)
