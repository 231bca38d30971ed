"""The node store's entry in the index (``store-<node>``): what the store holds, published
by one replica of the node at a time, so the routers can credit a stored prefix.

Every replica of a node writes into the one store, so no replica's own events describe it.
Instead the replica that holds the store's publisher ``flock`` (the first to take it; the
kernel hands it on when that replica dies) compares the store's slots with what it last
published, every ``interval_s``, and publishes the difference through an
``IndexPublisher`` of its own (registration, heartbeat, resync after a Redis restart:
everything a replica's entry has). When it stops, the entry is left to the next holder of
the lock, which registers again with the store's whole content; the node's last replica to
stop takes the entry out, after taking the lock (so no leader still stopping can put it
back).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvindex.records import store_id
from kvindex.writer import IndexWriter
from replica.engine.blocks.prefix_cache import CacheEvents
from replica.publisher import IndexPublisher
from replica.store.layout import VALID, join_hash
from replica.store.node_store import NodeStore

log = logging.getLogger("ray.serve")


class StorePublisher:
    def __init__(
        self,
        store: NodeStore,
        lock_path: str,
        node_id: str,
        writer: Callable[[], IndexWriter],
        stats: Callable[[], dict[str, Any]],
        interval_s: float = 0.5,
    ) -> None:
        self.store, self.lock_path, self.node_id = store, lock_path, node_id
        self.store_id = store_id(node_id)
        self._writer, self._stats, self.interval_s = writer, stats, interval_s
        self.publisher: IndexPublisher | None = None
        self._fd: int | None = None
        self._last = np.zeros(0, dtype=[("h0", "<u8"), ("h1", "<u8"), ("valid", "?")])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-publisher", daemon=True)

    def start(self) -> StorePublisher:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.publisher is None:
                    self._try_to_lead()
                else:
                    self.publish_changes()
            except Exception:  # the store's entry is a courtesy: never stop trying
                log.exception("publishing the node store failed")
            self._stop.wait(self.interval_s)

    def _take_lock(self) -> bool:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # another replica of this node publishes the store
            return False
        self._fd = fd
        return True

    def _try_to_lead(self) -> None:
        if not self._take_lock():
            return
        slots = self._slots()
        held = [join_hash(a, b) for a, b, v in slots.tolist() if v]
        self._last = slots
        self.publisher = IndexPublisher(
            self._writer(), self.store_id, cached=held, stats=self._stats
        ).start()

    def _slots(self) -> np.ndarray:
        meta = self.store.meta
        out = np.zeros(len(meta), dtype=self._last.dtype)
        out["h0"], out["h1"] = meta["h0"], meta["h1"]
        out["valid"] = (meta["flags"] & VALID) != 0
        return out

    def publish_changes(self) -> tuple[int, int]:
        """Hand what changed in the store since the last call to the publisher (stored,
        removed counts)."""
        assert self.publisher is not None
        now = self._slots()
        changed = np.flatnonzero(now != self._last)
        old, new = self._last[changed], now[changed]
        gone = {join_hash(a, b) for a, b, v in old.tolist() if v}
        came = [join_hash(a, b) for a, b, v in new.tolist() if v]
        gone.difference_update(came)
        self._last = now
        if came or gone:
            self.publisher.on_events(CacheEvents(tuple(came), tuple(gone)))
        return len(came), len(gone)

    @property
    def leading(self) -> bool:
        return self.publisher is not None

    def close(self, last: bool = False) -> None:
        """Stop publishing; with ``last`` (no replica of the node has the store open any
        more) also take the store's entry out of the index, whoever published it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.publisher is not None:  # else the next holder takes the entry over
            self.publisher.close(deregister=last)
        elif last:
            # the leader may be stopping at this very moment; until it lets the lock go its
            # publisher could still register the entry again, so wait for the lock first
            deadline = time.monotonic() + 2 * self.interval_s + 10
            while not self._take_lock() and time.monotonic() < deadline:
                time.sleep(0.05)
            writer = self._writer()
            try:
                epoch = writer.registered_epoch(self.store_id)
                if epoch is not None:
                    writer.deregister(self.store_id, epoch)
            except Exception:  # best effort, as a replica's own deregistration
                log.warning("could not take %s out of the index", self.store_id)
            finally:
                writer.close()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
