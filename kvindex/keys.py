"""The index's key layout: one contract for the replicas' writes and the routers' reads.

``{ns}`` = ``{ps:<cluster>:<model>}``, a hash tag, so all keys of a namespace share one slot
(the Lua scripts touch many of them at once); two clusters or models never share a key::

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
    {ns}:loads             HASH   "<replica>:<field>" for each of ``kvindex.records.LOAD_FIELDS``
                                  (prefill_tokens, in_flight, decode_blocks): the sums of
                                  each replica's bookings
    {ns}:reaping           STRING set while one caller reaps expired replicas
    {ns}:ev                STREAM the log of every change a query would see, entry ids
                                  ``0-<seq>`` (``kvindex.mirror`` follows it)
    {ns}:evseq             STRING the log's last sequence number
    {ns}:evid              STRING the log's name: set by its first event, so a fresh Redis
                                  (a restart) starts a log of another name
    {ns}:routers           HASH   router id -> when its shared bookings lapse (ms)
    {ns}:rl:<router>       STRING a mirroring router's shared bookings, "expiry|replica:
                                  prefill_tokens:in_flight:decode_blocks,...", with that TTL

The Lua scripts (``kvindex.scripts``) build these names themselves; the few keys Python reads
directly are built here. Only hashes are stored, never tokens or text; with a cluster secret
the hashes themselves are keyed (``kvindex.hashing``).
"""

from __future__ import annotations


def namespace(cluster: str, model_id: str) -> str:
    return f"{{ps:{cluster}:{model_id}}}"


def registry(ns: str) -> str:
    return f"{ns}:replicas"


def heartbeat(ns: str, replica_id: str) -> str:
    return f"{ns}:hb:{replica_id}"


def replica_blocks(ns: str, replica_id: str) -> str:
    return f"{ns}:r:{replica_id}"


def stats(ns: str, replica_id: str) -> str:
    return f"{ns}:stats:{replica_id}"
