"""What an index mirror holds, and its answer: plain data, no I/O (``kvindex.mirror`` feeds
it from Redis; tests feed it directly).

Invariants (``check``): a replica's bit is set in a block's holders exactly when the block
is in that replica's set; every replica with blocks, loads or predictions has a slot; slots
are reused only after their replica was purged (so no stale bit can name a new replica).
The answer reads a chain as ``QUERY`` does (``kvindex.scripts``): published runs and
predicted runs walked block by block, footprints, loads, for live replicas only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvindex.records import ReplicaState

HASH_BYTES = 16
LOAD_FIELDS = ("prefill", "active", "decode")


class MirrorState:
    def __init__(self, own_router: str | None = None) -> None:
        self.seq = 0  # the last event applied
        # routers' shared bookings (``SHARE``): each one's latest, and their sum per replica;
        # this router's own are left out (it adds its own bookings, fresher, itself)
        self.own_router = own_router
        self.shares: dict[str, tuple[float, dict[str, list[int]]]] = {}
        self.shared: dict[str, list[int]] = {}
        self.shared_in_flight = 0  # the sum of the shared requests, all replicas
        self.epochs: dict[str, str] = {}
        self.holders: dict[bytes, int] = {}  # block -> bitmask of replica slots
        self.blocks_of: dict[str, set[bytes]] = {}
        self.loads: dict[str, list[int]] = {}  # replica -> [prefill, active, decode]
        self.predicted: dict[bytes, dict[str, float]] = {}  # block -> replica -> expiry ms
        self.predicted_of: dict[str, set[bytes]] = {}
        self.live: list[str] = []
        self._live_mask = 0
        self._slot: dict[str, int] = {}
        self._rid: dict[int, str] = {}
        self._free: list[int] = []

    # --- changes (the log's events) ---

    def apply(self, fields: dict[bytes, bytes]) -> None:
        """One event of the log (``kvindex.lua.EMIT``)."""
        op, rid, a = fields[b"o"], fields[b"r"].decode(), fields[b"a"]
        if op == b"add":
            self.add(rid, _split(a))
        elif op == b"rem":
            self.remove(rid, _split(a))
        elif op == b"load":
            self.loads[rid] = [int(v) for v in a.split(b":")]
            self._slot_of(rid)
        elif op == b"pred":
            self.predict(rid, float(a), _split(fields[b"b"]))
        elif op == b"share":
            self.share(rid, a)
        elif op == b"purge":
            self.purge(rid)
        elif op == b"reg":
            self.register(rid, a.decode())
        elif op == b"dereg":
            self.purge(rid)
            self.epochs.pop(rid, None)
            self._release_slot(rid)
        else:
            raise ValueError(f"unknown index event {op!r}")

    def register(self, rid: str, epoch: str) -> None:
        self.epochs[rid] = epoch
        self._slot_of(rid)

    def add(self, rid: str, blocks: Iterable[bytes]) -> None:
        bit = 1 << self._slot_of(rid)
        mine = self.blocks_of.setdefault(rid, set())
        for block in blocks:
            mine.add(block)
            self.holders[block] = self.holders.get(block, 0) | bit

    def remove(self, rid: str, blocks: Iterable[bytes]) -> None:
        bit = 1 << self._slot_of(rid)
        mine = self.blocks_of.get(rid, set())
        for block in blocks:
            mine.discard(block)
            left = self.holders.get(block, 0) & ~bit
            if left:
                self.holders[block] = left
            else:
                self.holders.pop(block, None)

    def predict(self, rid: str, expiry_ms: float, blocks: Iterable[bytes]) -> None:
        self._slot_of(rid)
        mine = self.predicted_of.setdefault(rid, set())
        for block in blocks:
            self.predicted.setdefault(block, {})[rid] = expiry_ms
            mine.add(block)

    def purge(self, rid: str) -> None:
        """Everything of the replica: blocks, predictions, loads (its slot stays)."""
        self.remove(rid, list(self.blocks_of.pop(rid, ())))
        for block in self.predicted_of.pop(rid, ()):
            by_replica = self.predicted.get(block, {})
            by_replica.pop(rid, None)
            if not by_replica:
                self.predicted.pop(block, None)
        self.loads.pop(rid, None)

    def share(self, router: str, payload: bytes) -> None:
        """A router's shared bookings (``expiry|replica:prefill:active:decode,...``),
        replacing its last ones."""
        if router == self.own_router:
            return
        expiry, _, body = payload.partition(b"|")
        totals = {}
        for item in body.decode().split(",") if body else ():
            rid, *values = item.rsplit(":", 3)
            totals[rid] = [int(v) for v in values]
        self._unshare(router)
        self.shares[router] = (float(expiry), totals)
        for rid, values in totals.items():
            current = self.shared.setdefault(rid, [0, 0, 0])
            for i, v in enumerate(values):
                current[i] += v
            self.shared_in_flight += values[1]

    def expire_shares(self, now_ms: float) -> None:
        for router in [r for r, (expiry, _) in self.shares.items() if expiry <= now_ms]:
            self._unshare(router)

    def _unshare(self, router: str) -> None:
        _, old = self.shares.pop(router, (0.0, {}))
        for rid, values in old.items():
            current = self.shared[rid]
            for i, v in enumerate(values):
                current[i] -= v
            self.shared_in_flight -= values[1]
            if not any(current):
                del self.shared[rid]

    def set_load_field(self, rid: str, name: str, value: int) -> None:
        self.loads.setdefault(rid, [0, 0, 0])[LOAD_FIELDS.index(name)] = value
        self._slot_of(rid)

    def set_live(self, live: Sequence[str]) -> None:
        self.live = list(live)
        self._invalidate_live()

    def expire_predictions(self, now_ms: float) -> None:
        for block in list(self.predicted):
            by_replica = self.predicted[block]
            for rid in [r for r, expiry in by_replica.items() if expiry <= now_ms]:
                del by_replica[rid]
                self.predicted_of.get(rid, set()).discard(block)
            if not by_replica:
                del self.predicted[block]

    # --- the answer ---

    def answer(self, chain: Sequence[bytes], now_ms: float) -> dict[str, ReplicaState]:
        runs = self._published_runs(chain)
        predicted = self._predicted_runs(chain, now_ms)
        answer = {}
        for rid in self.live:
            prefill, active, decode = self.loads.get(rid, (0, 0, 0))
            if rid in self.shared:
                shared = self.shared[rid]
                prefill, active, decode = (
                    prefill + shared[0],
                    active + shared[1],
                    decode + shared[2],
                )
            answer[rid] = ReplicaState(
                rid,
                in_flight=active,
                booked_prefill_tokens=prefill,
                booked_decode_blocks=decode,
                cached_blocks=runs.get(rid, 0),
                predicted_blocks=predicted.get(rid, 0),
                footprint_blocks=len(self.blocks_of.get(rid, ())),
            )
        return answer

    def _published_runs(self, chain: Sequence[bytes]) -> dict[str, int]:
        """Live replicas' leading runs of ``chain`` (those with none are left out)."""
        if self._live_mask < 0:
            self._live_mask = sum(1 << self._slot_of(rid) for rid in self.live)
        runs: dict[str, int] = {}
        alive = self._live_mask
        for i, block in enumerate(chain):
            if not alive:
                break
            still = alive & self.holders.get(block, 0)
            self._name_runs(alive & ~still, i, runs)
            alive = still
        self._name_runs(alive, len(chain), runs)
        return runs

    def _name_runs(self, mask: int, run: int, runs: dict[str, int]) -> None:
        while mask and run:
            low = mask & -mask
            runs[self._rid[low.bit_length() - 1]] = run
            mask ^= low

    def _predicted_runs(self, chain: Sequence[bytes], now_ms: float) -> dict[str, int]:
        predicted: dict[str, int] = {}
        alive: set[str] | None = None
        for i, block in enumerate(chain):
            by_replica = self.predicted.get(block, {})
            now_there = {
                rid
                for rid, expiry in by_replica.items()
                if expiry > now_ms and (alive is None or rid in alive)
            }
            if not now_there:
                break
            for rid in now_there:
                predicted[rid] = i + 1
            alive = now_there
        return predicted

    # --- slots ---

    def _slot_of(self, rid: str) -> int:
        slot = self._slot.get(rid)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slot) + len(self._free)
            self._slot[rid], self._rid[slot] = slot, rid
        return slot

    def _release_slot(self, rid: str) -> None:
        slot = self._slot.pop(rid, None)
        if slot is not None:
            del self._rid[slot]
            self._free.append(slot)
            self._invalidate_live()

    def _invalidate_live(self) -> None:
        self._live_mask = -1  # recomputed at the next answer (a new replica's slot)

    def check(self) -> None:
        """The invariants of the module docstring."""
        for rid, blocks in self.blocks_of.items():
            bit = 1 << self._slot[rid]
            assert all(self.holders[b] & bit for b in blocks), rid
        for block, mask in self.holders.items():
            for slot, rid in self._rid.items():
                assert bool(mask >> slot & 1) == (block in self.blocks_of.get(rid, ())), block
        assert set(self._rid.values()) == set(self._slot)


def _split(joined: bytes) -> list[bytes]:
    return [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]
