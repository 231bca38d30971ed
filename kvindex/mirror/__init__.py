"""A router's live copy of the index: ``follower`` (snapshot, then the event log, resyncs),
``state`` (what the copy holds, answered as tables), ``holder_table`` (which replicas hold
each block: a numpy hash table)."""

from kvindex.mirror.follower import SNAPSHOT_CHUNK, IndexMirror

__all__ = ["SNAPSHOT_CHUNK", "IndexMirror"]
