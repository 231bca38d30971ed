"""``QueueLengths``: Serve's queue-length cache, readable as one numpy column per decision.

Serve's router keeps, per replica, the requests it last knew to be running there (a probe's
answer, +1 per request sent, -1 per request done), fresh for ``staleness_timeout_s``. The
routing core takes them as a floor for each replica's in-flight count. Read the plain way,
that is a ``get`` per candidate (a ``ReplicaID`` hashed, the clock read) and a Python loop
over the replicas with requests: at a thousand busy replicas, more than the whole decision.
Here every update also writes the replica's row of two arrays (length, time), so a decision
reads the floors of a list of replica ids with three array operations, the rows of that
list being looked up once per list (the routing core's lists are never changed in place).

Invariant (``check``): for every replica the cache holds, its row has the entry's length and
time; a row whose replica the cache dropped is stale (time -inf).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import ReplicaQueueLengthCache


class QueueLengths(ReplicaQueueLengthCache):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._row: dict[str, int] = {}
        self._length = np.zeros(64, np.int64)
        self._at = np.full(64, -np.inf)
        self._rows_of: tuple[list[str], np.ndarray] | None = None  # the last list's rows

    @classmethod
    def replacing(cls, cache: ReplicaQueueLengthCache) -> QueueLengths:
        """A cache with ``cache``'s clock, timeout and entries (Serve's own, swapped)."""
        new = cls(
            staleness_timeout_s=cache._staleness_timeout_s,
            get_curr_time_s=cache._get_curr_time_s,
        )
        for replica_id, entry in cache._cache.items():
            new._cache[replica_id] = entry
            new._set(replica_id.unique_id, entry.queue_len, entry.timestamp)
        return new

    def update(self, replica_id: ReplicaID, queue_len: int) -> None:
        super().update(replica_id, queue_len)
        self._set(replica_id.unique_id, queue_len, self._cache[replica_id].timestamp)

    def invalidate_key(self, replica_id: ReplicaID) -> None:
        super().invalidate_key(replica_id)
        self._forget(replica_id.unique_id)

    def remove_inactive_replicas(self, *, active_replica_ids: set[ReplicaID]) -> None:
        gone = [rid for rid in self._cache if rid not in active_replica_ids]
        super().remove_inactive_replicas(active_replica_ids=active_replica_ids)
        for replica_id in gone:
            self._forget(replica_id.unique_id)

    def column(self, ids: Sequence[str]) -> np.ndarray:
        """The fresh queue length of each of ``ids``, in order (0: none known, or stale),
        by Serve's rule: an entry older than the timeout is not read."""
        rows = self._rows(ids)
        fresh = self._at[rows] >= self._get_curr_time_s() - self._staleness_timeout_s
        return np.where(fresh, self._length[rows], 0)

    def _rows(self, ids: Sequence[str]) -> np.ndarray:
        last = self._rows_of
        if last is not None and last[0] is ids:
            return last[1]
        rows = np.array([self._row_of(rid) for rid in ids], np.int64)
        if isinstance(ids, list):  # kept alive with its rows, so its id is not reused
            self._rows_of = (ids, rows)
        return rows

    def _row_of(self, rid: str) -> int:
        row = self._row.get(rid)
        if row is None:
            row = self._row[rid] = len(self._row)
            if row >= self._length.size:  # grown: rows read before stay valid
                self._length = np.concatenate([self._length, np.zeros_like(self._length)])
                self._at = np.concatenate([self._at, np.full(self._at.size, -np.inf)])
        return row

    def _set(self, rid: str, length: int, at: float) -> None:
        row = self._row_of(rid)
        self._length[row], self._at[row] = length, at

    def _forget(self, rid: str) -> None:
        row = self._row.get(rid)
        if row is not None:
            self._at[row] = -np.inf

    def check(self) -> None:
        """The invariant of the module docstring."""
        held = {replica_id.unique_id: entry for replica_id, entry in self._cache.items()}
        for rid, row in self._row.items():
            entry = held.get(rid)
            if entry is None:
                assert self._at[row] == -np.inf, rid
            else:
                assert (self._length[row], self._at[row]) == (entry.queue_len, entry.timestamp)
