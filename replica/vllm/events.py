"""The replica's subscription to its own vLLM's KV events, and what happens when one is lost.

vLLM's ZMQ publisher numbers its event batches 0, 1, 2, ... and keeps the last
``buffer_steps`` of them for replay (a ROUTER socket: ask with a first sequence number, get
every buffered batch from there on, then an end marker). ZMQ drops messages when a queue is
full or before a subscriber's connection is up, silently; so the subscriber

* applies batches strictly in sequence (a batch it already has is skipped);
* on a gap (a batch numbered past the next one), asks the replay endpoint for the missing
  ones first; if they have left vLLM's buffer, it forgets the replica's whole cached set
  (the index entry is cleared: the router stops predicting hits there, it never predicts a
  hit that is not) and asks vLLM to reset its prefix cache (``on_lost``), after which both
  start again from empty; until vLLM's ``AllBlocksCleared`` arrives, blocks whose parents
  it lost are simply not published;
* when no batch came for ``probe_s``, asks for a replay from the next number anyway: a
  batch lost at the end of a burst shows no gap until the next one, and the index must not
  wait for the next request to be right.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from replica.engine.blocks.prefix_cache import CacheEvents
from replica.vllm.bridge import Cleared, Event, KVEventBridge, Lost, Removed, Stored

log = logging.getLogger("ray.serve")
_END = (-1).to_bytes(8, "big", signed=True)


@dataclass
class SubscriberCounters:
    batches: int = 0  # applied in sequence
    gaps: int = 0  # sequence gaps seen
    replayed: int = 0  # batches recovered from the replay endpoint
    lost: int = 0  # gaps the replay could not cover: the cached set was forgotten
    probes: int = 0  # idle replay requests

    def to_dict(self) -> dict[str, int]:
        return {f"kv_events_{k}": v for k, v in asdict(self).items()}


def to_events(batch: KVEventBatch) -> list[Event]:
    """vLLM's events as the bridge's records (only the main KV cache group is ours)."""
    out: list[Event] = []
    for e in batch.events:
        if isinstance(e, AllBlocksCleared):
            out.append(Cleared())
        elif getattr(e, "group_idx", None) not in (None, 0):
            continue  # hybrid models' other groups (sliding windows): not indexed
        elif isinstance(e, BlockStored):
            out.append(
                Stored(
                    e.block_hashes,
                    e.parent_block_hash,
                    e.token_ids,
                    e.block_size,
                    e.lora_name,
                    e.extra_keys,
                    e.medium,
                )
            )
        elif isinstance(e, BlockRemoved):
            out.append(Removed(e.block_hashes, e.medium))
    return out


class EventSubscriber:
    """One thread: SUB to vLLM's ``endpoint``, replay requests to ``replay_endpoint``,
    every batch through ``bridge`` in sequence. ``drop`` (tests only) names sequence numbers
    whose published copy is thrown away on arrival, as a full ZMQ queue would."""

    def __init__(
        self,
        bridge: KVEventBridge,
        endpoint: str,
        replay_endpoint: str,
        on_lost: Callable[[], None],
        probe_s: float = 1.0,
        drop: Iterable[int] = (),
    ) -> None:
        self.bridge = bridge
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.on_lost = on_lost
        self.probe_s = probe_s
        self.counters = SubscriberCounters()
        self.last = -1  # the last sequence number applied
        self.strict = True  # False after a lost gap, until vLLM says its cache is empty
        self._drop = set(drop)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (it polls in short waits) and drop its sockets unsent."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)  # never blocks, even on a socket left open

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sub.poll(int(self.probe_s * 1000)):
                    if not self._stop.is_set():
                        self._replay(self.last + 1, probe=True)
                    continue
                _, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq in self._drop:
                    self._drop.discard(seq)
                    continue
                self._deliver(seq, payload)
        except Exception:  # the index then goes stale: say so loudly, the replica reports it
            log.exception("the KV event subscriber stopped")
            raise
        finally:
            sub.close()

    def _deliver(self, seq: int, payload: bytes) -> None:
        if seq <= self.last:
            return
        if seq > self.last + 1:
            self.counters.gaps += 1
            self._replay(self.last + 1, probe=False)
            if seq <= self.last:
                return
            if seq > self.last + 1:  # the replay endpoint did not answer
                self._forget(f"batches {self.last + 1}-{seq - 1} could not be replayed")
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        events = to_events(self._decoder.decode(payload))
        try:
            if not self.strict:
                events = self._lenient(events)
            self.bridge.apply(events)
        except Lost as exc:
            self._forget(str(exc))
        self.last = seq
        self.counters.batches += 1

    def _lenient(self, events: list[Event]) -> list[Event]:
        """After a lost gap: events about blocks the bridge lost track of are left out (not
        published; never published wrong), until vLLM's cache is empty again."""
        if any(isinstance(e, Cleared) for e in events):
            self.strict = True
            return events
        kept: list[Event] = []
        known = self.bridge.ours
        for e in events:
            if isinstance(e, Stored) and e.parent is not None and e.parent not in known:
                continue
            if isinstance(e, Removed):
                e = Removed([h for h in e.block_hashes if h in known], e.medium)
            kept.append(e)
        return kept

    def _forget(self, why: str) -> None:
        log.warning("KV events lost (%s): index entry cleared, vLLM asked to reset", why)
        self.counters.lost += 1
        self.bridge.reset()
        self.bridge.on_events(CacheEvents((), (), cleared=True))
        self.strict = False
        self.on_lost()

    def _replay(self, start: int, probe: bool) -> None:
        """Ask vLLM for every buffered batch from ``start`` and apply them in sequence; a
        buffer that no longer reaches back to ``start`` is a lost gap."""
        if probe:
            self.counters.probes += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while self._answered(sock):
                _, _, seq_bytes, payload = sock.recv_multipart()
                if seq_bytes == _END:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq <= self.last:
                    continue
                if probe and seq == start:
                    self.counters.gaps += 1  # lost at the end of a burst: no gap showed
                if seq > self.last + 1:
                    self._forget(f"batches {self.last + 1}-{seq - 1} left vLLM's buffer")
                self._apply(seq, payload)
                self.counters.replayed += 1
            if not self._stop.is_set():
                log.warning("vLLM's replay endpoint did not answer")
        finally:
            sock.close()

    def _answered(self, sock: zmq.Socket, timeout_s: float = 5.0) -> bool:
        """A reply is waiting (within ``timeout_s``, in short polls: a stop is not kept
        waiting by an engine that no longer answers)."""
        for _ in range(int(timeout_s / 0.1)):
            if self._stop.is_set():
                return False
            if sock.poll(100):
                return True
        return False
