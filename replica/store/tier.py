"""The second cache tier as an engine uses it: spill released blocks into the node store
(behind the step), restore a prompt's stored blocks before it is admitted (verified).

Spill: a published block whose last holder releases it becomes evictable; from then on it
may be evicted in any step. So the engine hands it to the tier when it is released (the
step's end: ``Engine.step``), and the tier copies it into the store on its own thread,
off the step: when the pool later evicts it, its eviction costs nothing and it is already
kept. The copy is checked like a pull's: the block's generation in the pool is read
before and after, and a block evicted (and reused) meanwhile is dropped from the store
again. A block already stored is only touched. A block the store evicts after its second
use goes to the disk tier, if there is one.

Restore: before a request is admitted, the engine asks the tier for the blocks of its
prompt beyond its longest local hit: first the node store (read by reference, the
seqlock's rule), then the disk tier (bytes with a checksum). Both go through
``replica.kv.transfer.import_prefix``, which holds them to a local hit's rule (tokens,
the receiver's own hash, parent) and publishes them: the request then hits them like any
cached prefix, and ``cached_tokens`` counts them.

What this engine's spills add to the store and evict from it is reported to
``listeners`` as ``CacheEvents`` (the simulator's index keeps the store's entry so; a
replica's index entry for the store is published by ``replica.store_publisher``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from replica.engine.blocks.prefix_cache import CacheEvents
from replica.engine.faces import KVHandle
from replica.kv.transfer import ExportedBlock, PrefixExport, import_prefix
from replica.store.disk import DiskBlock, DiskTier
from replica.store.node_store import NodeStore
from replica.store.spill_items import SpillItem, published_blocks, released_blocks

if TYPE_CHECKING:
    from replica.engine.sequence import Sequence as Sequence_

log = logging.getLogger("ray.serve")


@dataclass
class TierCounters:
    spilled_blocks: int = 0  # written into the store
    spill_skipped: int = 0  # already stored (touched)
    spill_dropped: int = 0  # evicted from the pool mid-copy, or the store refused
    disk_spilled_blocks: int = 0  # store evictions written to disk
    restored_blocks: int = 0  # imported from the store
    restored_disk_blocks: int = 0  # imported from disk
    restore_rejected: int = 0  # found, then refused (verification, torn, no room)
    restore_seconds: float = 0.0
    spill_waits: int = 0  # finished requests whose answer waited for their spill
    spill_wait_seconds: float = 0.0  # how long they waited, in all
    spill_wait_timeouts: int = 0  # of them, those that gave up waiting (SPILL_WAIT_S)

    def to_dict(self) -> dict[str, Any]:
        return {f"store_{k}": v for k, v in asdict(self).items()}


@dataclass
class StoreTier:
    """A node store (and optional disk tier) as one engine uses it. ``background``: spill
    on a thread of its own (a replica); off: at once (the simulator, tests)."""

    store: NodeStore
    disk: DiskTier | None = None
    disk_after_uses: int = 2
    background: bool = True
    listeners: list[Callable[[CacheEvents], None]] = field(default_factory=list)
    counters: TierCounters = field(default_factory=TierCounters)

    def __post_init__(self) -> None:
        self._released: list[int] = []  # the engine's blocks released this step
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._progress = threading.Condition()
        self._handed = self._done = 0  # spill jobs handed to the thread, and finished

    # -- spill ----------------------------------------------------------------------------

    def attach(self, kv: KVHandle) -> None:
        """Be the tier of ``kv``'s engine: hear of every block its pool releases to the
        cache, and of every session's blocks released before their TTL (kept in the store
        until then: ``keep_session``)."""
        kv.on_release(self._released.append)
        kv.on_early_unpin(lambda *pin: self.keep_session(kv, *pin))

    def keep_session(self, kv: KVHandle, tenant: str, blocks: list[int], expires_at: float) -> None:
        """A session's pin is released before its TTL to make room: the pool will reuse
        its blocks at once, before this step's spill could copy them. So their rows are
        copied now, while the pin still holds them, and stored kept until ``expires_at``
        (``time.monotonic`` seconds: the store's clock) so its next turn restores them."""
        items = published_blocks(kv, blocks, tenant)
        if not items:
            return
        rows = kv.rows()[[item.block_id for item in items]]  # a copy (fancy indexing)
        until = int(expires_at * 1e9)
        kept = [
            replace(item, block_id=k, generation=0, keep_until_ns=until)
            for k, item in enumerate(items)
        ]
        self.spill(kept, rows, np.zeros(len(kept), np.int64))

    def after_step(self, kv: KVHandle) -> None:
        """Hand the blocks released in the step to the spiller (the step's end)."""
        if not self._released:
            return
        items = released_blocks(kv, self._released)
        self._released.clear()
        self.spill(items, kv.rows(), kv.allocator.generations)

    def spill(self, items: Sequence[SpillItem], pool: np.ndarray, generations: np.ndarray) -> None:
        """Copy released blocks of ``pool`` (uint8 rows, one a block) into the store."""
        if not items:
            return
        if not self.background:
            self._spill_now(items, pool, generations)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="store-spill", daemon=True)
            self._thread.start()
        self._idle.clear()
        with self._progress:
            self._handed += 1
        self._queue.put((items, pool, generations))

    def stats(self) -> dict[str, Any]:
        """The tier's counters and its store's, as a replica reports them (``store_*``)."""
        store = self.store.counters
        return {
            **self.counters.to_dict(),
            "store_hits": store.hits,
            "store_torn": store.torn,
            "store_full": store.full,
            "store_kept_full": store.kept_full,
            "store_blocks": self.store.num_blocks,
            "store_capacity": self.store.geometry.num_slots,
        }

    def ticket(self) -> int:
        """A mark of every spill handed over so far (``wait_spilled`` waits for them)."""
        with self._progress:
            return self._handed

    def spilled(self, ticket: int) -> bool:
        with self._progress:
            return self._done >= ticket

    def wait_spilled(self, ticket: int, timeout_s: float) -> bool:
        """Wait until the spills handed over before ``ticket`` are in the store; False if
        ``timeout_s`` passed first. A replica holds a finished request's answer back this
        way, so the next request for its prefix, on any replica of the node, restores it
        instead of racing the copy (a client's next request comes within milliseconds)."""
        start = time.perf_counter()
        with self._progress:
            done = self._progress.wait_for(lambda: self._done >= ticket, timeout_s)
        self.counters.spill_waits += 1
        self.counters.spill_wait_seconds += time.perf_counter() - start
        self.counters.spill_wait_timeouts += not done
        return done

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Whether every spill handed over so far is done (tests, shutdown)."""
        return self._idle.wait(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self._spill_now(*job)
            except Exception:  # never let one bad block stop spilling
                log.exception("spilling into the node store failed")
            with self._progress:
                self._done += 1
                self._progress.notify_all()
            if self._queue.empty():
                self._idle.set()

    def _spill_now(
        self, items: Sequence[SpillItem], pool: np.ndarray, generations: np.ndarray
    ) -> None:
        stored, removed = [], []
        for item in items:
            if int(generations[item.block_id]) != item.generation:
                self.counters.spill_dropped += 1  # evicted before we got to it
                continue
            result = self.store.put(
                item.block_hash,
                item.parent_hash,
                item.token_ids,
                pool[item.block_id],
                self.disk_after_uses if self.disk is not None else None,
                item.owner,
                item.keep_until_ns,
                item.weight,
            )
            if int(generations[item.block_id]) != item.generation:  # reused mid-copy
                if result.stored:
                    self.store.discard(item.block_hash)
                self.counters.spill_dropped += 1
                continue
            if not result.stored:
                self.counters.spill_skipped += self.store.find(item.block_hash) is not None
                continue
            self.counters.spilled_blocks += 1
            stored.append(item.block_hash)
            if result.evicted is not None:
                removed.append(result.evicted.block_hash)
                self._to_disk(result.evicted, result.evicted_bytes)
        self._emit(stored, removed)

    def _to_disk(self, block: Any, data: bytes | None) -> None:
        if self.disk is None or data is None:
            return
        disk_block = DiskBlock(block.block_hash, block.parent_hash, block.token_ids, data)
        self.counters.disk_spilled_blocks += self.disk.write(disk_block)

    def _emit(self, stored: list[bytes], removed: list[bytes]) -> None:
        if not stored and not removed:
            return
        gone = set(removed) - set(stored)
        events = CacheEvents(tuple(stored), tuple(h for h in removed if h in gone))
        for listener in self.listeners:
            listener(events)

    # -- restore --------------------------------------------------------------------------

    def restore(self, kv: KVHandle, seq: Sequence_) -> int:
        """Import the stored blocks of ``seq``'s tokens beyond the engine's local hit (store,
        then disk); how many blocks it imported. Runs on the engine's thread, when ``seq``
        is added (its block hashes are computed here once, for admission too)."""
        bs = kv.block_size
        usable = (seq.num_tokens - 1) // bs
        if kv.cache is None or usable <= 0:
            return 0
        start = time.perf_counter()
        prompt, salt = seq.token_ids[: usable * bs], seq.cache_salt
        hashes = kv.manager.chain(seq, usable * bs)
        held = len(kv.lookup(prompt, salt, hashes))
        imported = 0
        if held < usable:
            imported = self._from_store(kv, prompt, salt, hashes, held)
        if self.disk is not None and held + imported < usable:
            imported += self._from_disk(kv, prompt, salt, hashes, held + imported)
        if held < usable:
            self.counters.restore_seconds += time.perf_counter() - start
        return imported

    def _from_store(
        self, kv: KVHandle, prompt: list[int], salt: str | None, hashes: list[bytes], held: int
    ) -> int:
        found = self.store.find_chain(hashes, start=held)
        if not found:
            return 0
        blocks = tuple(
            ExportedBlock(b.block_hash, b.parent_hash, b.token_ids, 0, b.slot, b.seq) for b in found
        )
        export = PrefixExport(kv.layout, blocks, store=self.store, stored=tuple(found), first=held)
        result = import_prefix(kv, prompt, salt, export, hashes)
        self.counters.restored_blocks += result.imported
        self.counters.restore_rejected += len(found) - result.imported
        return result.imported

    def _from_disk(
        self, kv: KVHandle, prompt: list[int], salt: str | None, hashes: list[bytes], held: int
    ) -> int:
        assert self.disk is not None
        found = self.disk.read_chain(hashes[held:])
        if not found:
            return 0
        rows = np.frombuffer(b"".join(b.data for b in found), np.uint8).reshape(len(found), -1)
        blocks = tuple(
            ExportedBlock(b.block_hash, b.parent_hash, b.token_ids, zlib.crc32(row))
            for b, row in zip(found, rows, strict=True)
        )
        export = PrefixExport(kv.layout, blocks, rows, first=held)
        result = import_prefix(kv, prompt, salt, export, hashes)
        self.counters.restored_disk_blocks += result.imported
        self.counters.restore_rejected += len(found) - result.imported
        return result.imported
