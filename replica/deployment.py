"""``EngineReplica``: the Ray Serve deployment that runs one engine.

One background task steps the engine; every engine call runs on one dedicated thread, so the
engine itself needs no locks and the replica's event loop never blocks on a forward pass.
Requests stream their tokens back as the steps produce them. The replica feeds its block
events to the Redis index (a background publisher thread, never in the step's way),
heartbeats there, and deregisters on shutdown.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import ray
from ray import serve

from kvindex.writer import IndexWriter
from replica.config import EngineConfig, ReplicaArgs
from replica.messages import EngineRequest, PullRequest, RequestOutput
from replica.publisher import IndexPublisher
from replica.store.files import publisher_lock_path
from replica.store_publisher import StorePublisher

if TYPE_CHECKING:
    from replica.engine.transfer import PrefixExport

# how long a finished answer waits for its blocks' spill (it is ~1 ms a block; a spiller
# that far behind must not hold answers back)
SPILL_WAIT_S = 1.0

log = logging.getLogger("ray.serve")


def _rss_mb() -> float | None:
    """Resident memory of this process (Linux), for the overload and soak reports."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


class EngineFailedError(RuntimeError):
    """The engine loop crashed; the replica reports unhealthy and Serve replaces it."""


@serve.deployment(max_ongoing_requests=32)
class EngineReplica:
    def __init__(self, args: dict[str, Any] | ReplicaArgs) -> None:
        # torch and the engine load here, in the replica, not where this module is imported
        # to build the app (``cluster.app``, in a worker of its own at every deploy)
        from replica.engine import Engine
        from replica.pull import Puller

        self.args = ReplicaArgs.model_validate(args)
        self.engine = Engine(_engine_config(self.args))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()  # where it runs (stats)
        self.publisher = IndexPublisher(
            IndexWriter(self.args.index, self.args.engine.model_id),
            self.replica_id,
            stats=self.record_routing_stats,
        )
        self.engine.subscribe(self.publisher.on_events)
        self.store_publisher: StorePublisher | None = None
        self._attach_store()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending: set[asyncio.Task[None]] = set()  # answers waiting for their spill
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._audits = 0
        self._audit_error: str | None = None
        self._left = False
        self.puller = Puller(
            self.engine,
            self._on_engine,
            self.replica_id,
            self.args.index,
            self.args.pull,
            self.node_id,
        )
        atexit.register(self._leave_index)
        self.publisher.start()

    def _attach_store(self) -> None:
        """The node's store as the engine's second tier, and its index entry published by
        one replica of the node (``replica.store_publisher``)."""
        from replica.store.build import build_tier

        tier = build_tier(self.engine, self.args.store, self.args.index)
        if tier is None:
            return
        self.engine.attach_store(tier)
        store = tier.store
        args = self.args

        def store_stats() -> dict[str, Any]:
            return {"kind": "store", "node_id": self.node_id, "blocks": store.num_blocks}

        self.store_publisher = StorePublisher(
            store,
            publisher_lock_path(getattr(store, "path", "")),
            self.node_id,
            lambda: IndexWriter(args.index, args.engine.model_id),
            store_stats,
        ).start()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's tokens. Raises ``InvalidRequestError`` before the first chunk
        if the engine can never serve it; a cancelled stream aborts the request."""
        self._start_loop()
        if self._failure is not None:
            raise EngineFailedError("the engine loop failed") from self._failure
        loop = asyncio.get_running_loop()
        rid = request.request_id
        add = functools.partial(
            self.engine.add_request,
            rid,
            request.prompt_token_ids,
            request.params,
            cache_salt=request.cache_salt,
            output_token_ids=request.output_token_ids,
        )
        structured = request.params.structured
        if structured is not None:  # compiled (once per schema) off the engine's thread
            await loop.run_in_executor(None, self.engine.grammars.compile, structured)
        await self.puller.before_admission(request)
        await loop.run_in_executor(self._executor, add)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[rid] = queue
        assert self._wakeup is not None
        self._wakeup.set()
        unfinished = request.params.n  # the stream ends when every choice has
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineFailedError("the engine loop failed") from item
                unfinished -= item.finished
                finished = unfinished == 0
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:  # cancelled or disconnected: free its blocks (not awaited)
                loop.run_in_executor(self._executor, self.engine.abort_request, rid)

    async def export_prefix(self, request: PullRequest) -> PrefixExport:
        """This replica's verified cached prefix of another replica's prompt (between steps,
        on the engine's thread)."""
        from replica.engine.transfer import export_prefix

        by_reference = request.node_id == self.node_id and self.args.pull.shared_memory
        return await self._on_engine(
            export_prefix,
            self.engine,
            request.prompt_token_ids,
            request.cache_salt,
            by_reference,
        )

    async def _on_engine(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` on the engine's thread (between steps, never during one)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args)
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """The engine's counters (``EngineStats`` names, no latency percentiles: this runs
        every stats period and heartbeat) plus what only the replica knows."""
        publisher = self.publisher.counters
        return {
            **self.engine.stats(latencies=False).to_dict(),
            "replica_id": self.replica_id,
            "time": time.time(),
            "in_flight": len(self._streams),
            "index_in_sync": self.publisher.in_sync,
            "index_failures": publisher.failures,
            "index_resyncs": publisher.resyncs,
            "index_dropped_batches": publisher.dropped_batches,
            "index_overflows": publisher.overflows,
            "epoch": self.publisher.epoch,
            "pid": os.getpid(),
            "node_id": self.node_id,
            "rss_mb": _rss_mb(),
            **self.puller.counters.to_dict(),
            **self._store_stats(),
            "idle_audits": self._audits,
            "audit_error": self._audit_error,
        }

    def _store_stats(self) -> dict[str, Any]:
        tier = self.engine.store
        if tier is None:
            return {}
        store = tier.store.counters
        return {
            **tier.counters.to_dict(),
            "store_hits": store.hits,
            "store_torn": store.torn,
            "store_full": store.full,
            "store_blocks": tier.store.num_blocks,
            "store_capacity": tier.store.geometry.num_slots,
            "store_publisher": self.store_publisher is not None and self.store_publisher.leading,
        }

    def check_health(self) -> None:
        if self._failure is not None:
            raise EngineFailedError("the engine loop failed") from self._failure

    async def __del__(self) -> None:
        """Serve's graceful stop (Ctrl-C, scale-down, redeploy), after the replica's
        running requests finished or its graceful-shutdown timeout passed."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._leave_index()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _leave_index(self) -> None:
        """Deregister (once). Also at interpreter exit: a SIGTERM to ``serve run`` (what
        systemd, Kubernetes and ``docker stop`` send) makes Ray SIGTERM its workers, whose
        handler exits the interpreter without ``__del__``; ``atexit`` still runs."""
        if not self._left:
            self._left = True
            self.publisher.close(deregister=True)
            store = self.engine.store.store if self.engine.store is not None else None
            last = bool(getattr(store, "leave", lambda: False)())  # the node's last replica
            if self.store_publisher is not None:
                leading = self.store_publisher.leading
                self.store_publisher.close(last=last)
                log.info("left the index (node store: last user %s, publisher %s)", last, leading)
            if self.engine.store is not None:
                self.engine.store.wait_idle(2.0)  # its mapping stays: steps may still run

    def _start_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            if not self.engine.has_unfinished_requests():
                await loop.run_in_executor(self._executor, self._audit)
                self._wakeup.clear()
                if not self.engine.has_unfinished_requests():
                    await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # a bug: fail every stream now rather than hang them
                log.exception("engine step failed on replica %s", self.replica_id)
                self._failure = exc
                for queue in self._streams.values():
                    queue.put_nowait(exc)
                return
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Every choice streams with its request; a finished one once the blocks its step
        released are in the node store (``StoreTier.wait_spilled``), so the client's next
        request for the prefix finds them on any replica of the node."""
        tier = self.engine.store
        ticket = tier.ticket() if tier is not None else 0
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is None:
                continue
            item = out.streamed(self.replica_id)
            if out.finished and tier is not None and not tier.spilled(ticket):
                wait = functools.partial(tier.wait_spilled, ticket, SPILL_WAIT_S)
                self._spawn(self._after(wait, queue, item))
            else:
                queue.put_nowait(item)

    async def _after(
        self, wait: Any, queue: asyncio.Queue[RequestOutput | BaseException], item: RequestOutput
    ) -> None:
        await asyncio.get_running_loop().run_in_executor(None, wait)  # off the engine's thread
        queue.put_nowait(item)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._pending.discard)

    def _audit(self) -> None:
        """Check the block accounting whenever the engine falls idle (on its thread)."""
        try:
            self.engine.check_invariants(idle=True)
        except AssertionError as exc:
            log.error("block accounting broken on replica %s: %s", self.replica_id, exc)
            self._audit_error = str(exc) or "invariant violated"
        self._audits += 1


def _engine_config(args: ReplicaArgs) -> EngineConfig:
    """``num_threads`` unset: as many torch threads as CPUs Ray gave this replica (rounded
    up), so replicas sharing a machine do not oversubscribe it. The pool is shared memory
    when same-node pulls read it."""
    update: dict[str, Any] = {}
    if args.engine.num_threads is None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        update["num_threads"] = max(1, math.ceil(cpus))
    if args.pull.enabled and args.pull.shared_memory:
        update["shared_kv_pool"] = True
    return args.engine.model_copy(update=update)
