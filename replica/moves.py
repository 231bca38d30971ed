"""Moving a replica's streams, and its hot prefixes, to other replicas, token-exact.

A move stops a stream between two engine steps, exports the KV of its prompt and every
output token so far (its full blocks, verified, as ``replica.kv.transfer`` exports a
prefix) and pushes it to another replica (``EngineReplica.accept_kv``, which imports it as
a pull imports one). The stream's last output here says where it went (``Move``); the
ingress then sends the request on as a continuation (prompt + what the client already has,
as after a failure), first to that replica, which finds the KV cached and computes only the
last partial block. The engine's output is the same token for token and logit for logit: a
cache hit changes nothing, and its sampler is keyed by position (``cluster.engine_stream``).

Where a push fails (the target died, timed out, or refused the blocks) the stream still
ends here with ``Move.target`` None, and the next replica recomputes what it lacks: a move
can cost time, never a token. A request with several choices is never moved (its choices
would each need a continuation); it finishes where it is.

Three things move streams: Serve stopping this replica (``leave``: every stream at once,
then its hot prefixes, ``replica.handoff``), an operator's order (``MoveOrder``), and the
balancer (``replica.balance``), which moves running decodes to a replica that can run them
sooner.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextvars import Context
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from kvindex.records import RoutingRequest
from replica.engine_loop import Stream
from replica.handoff import HotPrefix, hot_prefixes
from replica.messages import KVPush, Move, RequestOutput
from replica.move_config import MoveConfig

if TYPE_CHECKING:
    from replica.engine.engine import Engine
    from replica.kv.transfer import PrefixExport

log = logging.getLogger("ray.serve")
WATCH_PERIOD_S = 0.05  # how often Serve's stop flag is read (an attribute read)
FINISH_POLL_S = 0.1  # how often a stopping replica looks for others to hand prefixes to
AFFINITY_BLOCKS = 4  # the routing key's K a pushed prefix carries (``ClusterArgs`` default)


@dataclass
class MoveCounters:
    moves: int = 0  # streams moved off this replica
    moves_failed: int = 0  # of those: their KV went nowhere (the next replica recomputes)
    moved_blocks: int = 0  # KV blocks pushed with moved streams
    moved_bytes: int = 0
    move_seconds: float = 0.0  # from stopping a stream to its KV taken (or given up)
    moves_received: int = 0  # pushes this replica took (streams and prefixes)
    received_blocks: int = 0  # blocks they published here
    handoff_prefixes: int = 0  # hot prefixes a leaving replica pushed on
    handoff_blocks: int = 0
    leave_seconds: float = 0.0  # from Serve's stop to every stream and prefix handed on

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Taken:
    """A stream stopped for a move: its tokens, salt and KV."""

    token_ids: list[int]
    cache_salt: str | None
    export: PrefixExport


class Mover:
    def __init__(
        self,
        engine: Engine,
        streams: dict[str, Stream],
        run_on_engine: Callable[..., Awaitable[Any]],
        handle: Callable[[], Any],
        replica_id: str,
        config: MoveConfig,
    ) -> None:
        self.engine, self.streams, self.config = engine, streams, config
        self.run_on_engine = run_on_engine  # async (fn, *args): run on the engine's thread
        self.handle = handle  # this deployment's Serve handle (routes ``accept_kv``)
        self.replica_id = replica_id
        self.counters = MoveCounters()
        self.left = False
        self.balancer: Callable[[], Awaitable[None]] | None = None  # ``replica.balance``
        self._task: asyncio.Task[None] | None = None
        self._moving: set[asyncio.Task[Move | None]] = set()

    def watch(self) -> None:
        """Start watching for Serve's stop (and balancing), on the replica's loop, once: at
        its first request or push (a replica that never had one has nothing to hand on)."""
        if self._task is None and self.config.enabled:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def finish(self, others: Callable[[], Awaitable[bool]]) -> None:
        """Serve's last call (``__del__``, after this replica left the index): a leave under
        way finishes first, then the watch stops. Serve calls it as soon as the streams
        have moved off (its ongoing requests are what it waits for), while the hot prefixes
        may still be on their way: stopping at once cut that hand-off short. It waits while
        ``others`` says another replica is still in the index (none: the whole deployment
        is stopping, nothing can take a prefix, and a push would only wait out its
        timeout), at most the hand-off's deadline plus one push's timeout."""
        task, bound = self._task, self.config.handoff_s + self.config.push_timeout_s
        deadline = time.monotonic() + bound
        while task is not None and self.left and not task.done():
            if time.monotonic() >= deadline or not await others():
                break
            await asyncio.wait({task}, timeout=FINISH_POLL_S)
        self.stop()

    async def _watch(self) -> None:
        from replica.leaving import stop_flag

        stopping = stop_flag()
        next_balance = time.monotonic()
        while not self.left:
            if stopping is not None and stopping():
                await self.leave()
                return
            if self.balancer is not None and time.monotonic() >= next_balance:
                next_balance = time.monotonic() + self.config.balance_period_s
                try:
                    await self.balancer()
                except Exception:  # a balancing defect must not end the watch for Serve's stop
                    log.exception("balancing failed")
            await asyncio.sleep(WATCH_PERIOD_S)

    def arrived(self, request_id: str) -> None:
        """A request that reached this replica after it began to leave goes on elsewhere."""
        if self.left:
            task = asyncio.get_running_loop().create_task(self.move(request_id, None, "leaving"))
            self._moving.add(task)  # held until done (the loop keeps weak references only)
            task.add_done_callback(self._moving.discard)

    async def move_many(
        self,
        to: str | None,
        max_streams: int | None,
        reason: str,
        timeout_s: float | None = None,
        decoding: bool = False,
    ) -> list[Move]:
        """Move streams (longest remaining first, at most ``max_streams``; with
        ``decoding``, only those past their first token) at once."""
        movable = await self.run_on_engine(self.engine.movable, decoding)
        ids = [rid for rid, _ in movable if rid in self.streams][:max_streams]
        moves = await asyncio.gather(*(self.move(rid, to, reason, timeout_s) for rid in ids))
        return [m for m in moves if m is not None]

    async def move(
        self, request_id: str, to: str | None, reason: str, timeout_s: float | None = None
    ) -> Move | None:
        """Stop ``request_id`` here, push its KV (to ``to``, else where the router sends
        it), and end its stream with the ``Move`` (None: not a movable stream here)."""
        queue = self.streams.get(request_id)
        if queue is None:
            return None
        started = time.monotonic()
        taken: Taken | None = await self.run_on_engine(self._take, request_id)
        if taken is None:
            return None
        target = await self._push(taken, to, request_id, timeout_s)
        c = self.counters
        c.moves += 1
        c.moves_failed += target is None and (to is not None or bool(taken.export.blocks))
        c.moved_blocks += len(taken.export.blocks)
        c.moved_bytes += taken.export.num_bytes
        seconds = time.monotonic() - started
        c.move_seconds += seconds
        tokens = len(taken.export.blocks) * self.engine.config.block_size
        move = Move(target, tokens, taken.export.num_bytes, seconds, reason)
        queue.put_nowait(_moved_output(request_id, taken, move, self.replica_id))
        return move

    def _take(self, request_id: str) -> Taken | None:
        """On the engine's thread, between steps: stop the request, export its KV."""
        from replica.kv.transfer import export_prefix

        detached = self.engine.detach(request_id)
        if detached is None or self.engine.kv is None:
            return None
        token_ids, salt = detached
        return Taken(token_ids, salt, export_prefix(self.engine.kv, token_ids, salt))

    async def _push(
        self, taken: Taken, to: str | None, key: str, timeout_s: float | None = None
    ) -> str | None:
        """Hand ``taken``'s KV to ``to`` (else the router's pick): who took it (None: nobody
        did in time, or there was nothing to push and no target was named)."""
        if not taken.export.blocks and to is None:
            return None
        route = None if to is not None else self._route(taken.token_ids, taken.cache_salt, key)
        push = KVPush(taken.token_ids, taken.cache_salt, taken.export, route, to, self.replica_id)
        wait = self.config.push_timeout_s if timeout_s is None else timeout_s
        # A call made while serving a request carries that request's internal id, by which
        # Serve's router matches a replica to a pending call: several pushes of one order (or
        # one leave) would take each other's place, and all but one never be sent. A task
        # in an empty context makes each a call of its own, with an id of its own.
        call = self._call(push, wait)
        try:
            return await asyncio.get_running_loop().create_task(call, context=Context())
        except Exception as exc:  # dead, late or refusing: the next replica recomputes
            log.warning("pushing %s's KV failed: %s", key, type(exc).__name__)
            return None

    async def _call(self, push: KVPush, wait: float) -> str:
        return str(await asyncio.wait_for(self.handle().accept_kv.remote(push), wait))

    def _route(self, token_ids: list[int], salt: str | None, key: str) -> RoutingRequest:
        """How the router sees a push it places: like a request for that prefix."""
        hasher = self.engine.hasher
        chain = hasher.chain(token_ids, salt)
        return RoutingRequest(
            request_id=f"{key}.push-{uuid.uuid4().hex[:8]}",
            block_hashes=chain,
            affinity_key=hasher.affinity_key(token_ids, AFFINITY_BLOCKS, salt, chain),
            num_prompt_tokens=len(token_ids),
            block_size=hasher.block_size,
        )

    async def leave(self) -> None:
        """Serve is stopping this replica: move every stream, then hand on the hot
        prefixes, within ``handoff_s`` for the prefixes (once)."""
        if self.left:
            return
        self.left = True
        started = time.monotonic()
        moves = await self.move_many(None, None, "leaving")
        handed = await self._hand_off(started + max(0.0, self.config.handoff_s))
        self.counters.leave_seconds = time.monotonic() - started
        log.info(
            "leaving: moved %d streams (%d failed) and %d hot prefixes in %.2f s",
            len(moves),
            sum(m.target is None for m in moves),
            handed,
            self.counters.leave_seconds,
        )

    async def _hand_off(self, deadline: float) -> int:
        """Push the hot prefixes, hottest first, two at a time, until the deadline."""
        hot: list[HotPrefix] = await self.run_on_engine(
            hot_prefixes, self.engine.kv, self.config.handoff_blocks
        )
        handed = 0
        for i in range(0, len(hot), 2):
            if time.monotonic() >= deadline:
                break
            pushed = await asyncio.gather(*(self._push_prefix(p) for p in hot[i : i + 2]))
            handed += sum(pushed)
        return handed

    async def _push_prefix(self, prefix: HotPrefix) -> bool:
        from replica.kv.transfer import export_prefix

        export = await self.run_on_engine(
            export_prefix, self.engine.kv, prefix.token_ids, prefix.cache_salt
        )
        taken = Taken(prefix.token_ids, prefix.cache_salt, export)
        if await self._push(taken, None, "handoff") is None:
            return False
        self.counters.handoff_prefixes += 1
        self.counters.handoff_blocks += len(export.blocks)
        return True

    def received(self, blocks: int) -> None:
        self.counters.moves_received += 1
        self.counters.received_blocks += blocks


def _moved_output(request_id: str, taken: Taken, move: Move, replica_id: str) -> RequestOutput:
    """The stream's last output here: no token, where it goes on."""
    out = RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        token_ids=[],
        finished=False,
        finish_reason=None,
        num_prompt_tokens=len(taken.token_ids),
        num_cached_tokens=0,
    )
    return replace(out, replica_id=replica_id, moved=move)
