"""The task that steps one replica's engine and hands each output to its request's stream.

Every engine call runs on one dedicated thread (``executor``), so the engine needs no locks
and the replica's event loop never blocks on a forward pass. The loop sleeps while the
engine has nothing to do (auditing its block accounting each time it falls idle) and wakes
when a request arrives. A finished answer leaves once the blocks its step released are in
the node store (``StoreTier.wait_spilled``, at most ``SPILL_WAIT_S``), so the client's next
request for the prefix finds them on any replica of the node. A step that raises is a bug:
every stream fails at once (the replica then reports unhealthy and Serve replaces it)
rather than hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from replica.errors import RequestFailedError
from replica.messages import RequestOutput

if TYPE_CHECKING:
    from replica.engine.engine import Engine
    from replica.store.tier import StoreTier

# how long a finished answer waits for its blocks' spill (~1 ms a block; a spiller that far
# behind must not hold answers back)
SPILL_WAIT_S = 1.0

log = logging.getLogger("ray.serve")
Stream = asyncio.Queue[RequestOutput | BaseException]


class EngineLoop:
    """The stepping task of ``engine``; ``streams`` maps a request id to its queue."""

    def __init__(
        self,
        engine: Engine,
        executor: ThreadPoolExecutor,
        replica_id: str,
        tier: StoreTier | None = None,
    ) -> None:
        self.engine, self.executor, self.replica_id = engine, executor, replica_id
        self.tier = tier  # the engine's node store, whose spills a finished answer awaits
        self.streams: dict[str, Stream] = {}
        self.failure: BaseException | None = None
        self.audits = 0
        self.audit_error: str | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()  # answers waiting for their spill

    def wake(self) -> None:
        """Start the task (on the replica's loop, at its first request) or wake it."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        assert self._wakeup is not None
        self._wakeup.set()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            if not self.engine.has_unfinished_requests():
                await loop.run_in_executor(self.executor, self._audit)
                self._wakeup.clear()
                if not self.engine.has_unfinished_requests():
                    await self._idle()
                continue
            try:
                outputs = await loop.run_in_executor(self.executor, self.engine.step)
            except Exception as exc:  # a bug: fail every stream now rather than hang them
                log.exception("engine step failed on replica %s", self.replica_id)
                self.failure = exc
                for queue in self.streams.values():
                    queue.put_nowait(exc)
                return
            self._deliver(outputs)

    async def _idle(self) -> None:
        """Wait for a request; meanwhile release the sessions' pins as their TTLs pass (an
        idle engine runs no step that would)."""
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while not self._wakeup.is_set():
            wait = await loop.run_in_executor(self.executor, self.engine.expire_retention)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), None if wait is None else wait + 0.01)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Every choice streams with its request; a finished one once its spill is done."""
        tier = self.tier
        ticket = tier.ticket() if tier is not None else 0
        for out in outputs:
            queue = self.streams.get(out.request_id)
            if queue is None:
                continue
            if out.error is not None:  # this request failed in the engine, nothing else
                queue.put_nowait(RequestFailedError(out.error))
                continue
            item = out.streamed(self.replica_id)
            if out.finished and tier is not None and not tier.spilled(ticket):
                wait = functools.partial(tier.wait_spilled, ticket, SPILL_WAIT_S)
                self._spawn(_after(wait, queue, item))
            else:
                queue.put_nowait(item)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._pending.discard)

    def _audit(self) -> None:
        """Check the block accounting whenever the engine falls idle (on its thread)."""
        try:
            self.engine.check_invariants(idle=True)
        except AssertionError as exc:
            log.error("block accounting broken on replica %s: %s", self.replica_id, exc)
            self.audit_error = str(exc) or "invariant violated"
        self.audits += 1


async def _after(wait: Callable[[], bool], queue: Stream, item: RequestOutput) -> None:
    await asyncio.get_running_loop().run_in_executor(None, wait)  # off the engine's thread
    queue.put_nowait(item)


def timed(call: Callable[[], object]) -> float:
    """``call()`` (run on the engine's thread by the caller's executor); when it began there:
    what waited before it, since it was handed over, was the thread's work in progress."""
    began = time.monotonic()
    call()
    return began
