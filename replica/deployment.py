"""``EngineReplica``: the Ray Serve deployment that runs one engine.

One background task steps the engine (``replica.engine_loop``); every engine call runs on one
dedicated thread. Requests stream their tokens back as the steps produce them. The replica
feeds its block events to the Redis index (a background publisher thread, never in the
step's way), heartbeats there, and deregisters on shutdown.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from redis.exceptions import RedisError

from kvindex.writer import IndexWriter
from replica import process, telemetry
from replica.args import ReplicaArgs
from replica.engine_loop import EngineLoop, timed
from replica.errors import RequestFailedError
from replica.messages import EngineRequest, KVPush, Move, MoveOrder, PullRequest, RequestOutput
from replica.moves import Mover
from replica.publisher import IndexPublisher
from replica.store.files import publisher_lock_path
from replica.store_publisher import StorePublisher
from replica.trace_spans import record_replica_spans

if TYPE_CHECKING:  # torch loads in the replica's process only, not where the app is built
    from replica.kv.transfer import PrefixExport
    from replica.pull import PullOutcome
    from replica.store.tier import StoreTier

log = logging.getLogger("ray.serve")


class EngineFailedError(RuntimeError):
    """The engine loop crashed; the replica reports unhealthy and Serve replaces it."""


@serve.deployment(max_ongoing_requests=32)
class EngineReplica:
    def __init__(self, args: dict[str, Any] | ReplicaArgs) -> None:
        # torch and the engine load here, in the replica, not where this module is imported
        # to build the app (``cluster.app``, in a worker of its own at every deploy)
        from replica.engine.engine import Engine
        from replica.model.runner import ModelRunner
        from replica.pull import Puller

        self.args = ReplicaArgs.model_validate(args)
        config = process.engine_config(self.args)
        self.runner = ModelRunner(config)  # the engine is handed its runner
        self.engine = Engine(config, self.runner)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()  # where it runs (stats)
        self.publisher = IndexPublisher(
            IndexWriter(self.args.index, self.args.engine.model_id),
            self.replica_id,
            stats=self.record_routing_stats,
        )
        self.engine.subscribe(self.publisher.on_events)
        self.store_publisher: StorePublisher | None = None
        self.tier: StoreTier | None = None  # the node store, the engine's second tier
        self._attach_store()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine_loop = EngineLoop(self.engine, self._executor, self.replica_id, self.tier)
        self._left = False
        self.puller = Puller(
            self.engine,
            self._on_engine,
            self.replica_id,
            self.args.index,
            self.args.pull,
            self.node_id,
        )
        self.mover = Mover(
            self.engine,
            self.engine_loop.streams,
            self._on_engine,
            self.puller.handle,
            self.replica_id,
            self.args.moves,
        )
        if self.args.moves.balance:  # live migration (``replica.balance``)
            from replica.balance import Balancer

            self.mover.balancer = Balancer(self.mover, self.puller.reader.replica_stats)
        atexit.register(self._leave_index)
        self.publisher.start()

    def _attach_store(self) -> None:
        """The node's store as the engine's second tier, and its index entry published by
        one replica of the node (``replica.store_publisher``)."""
        from replica.store.build import build_tier

        tier = build_tier(self.engine, self.runner.kv_source, self.args.store, self.args.index)
        if tier is None:
            return
        self.engine.attach_store(tier)
        self.tier = tier
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
        if the engine can never serve it; a cancelled stream aborts the request. The first
        output of choice 0 says how many prompt tokens were pulled for it; a traced request
        (``trace_parent``) leaves its spans here once it is over (``replica.trace_spans``)."""
        if self.engine_loop.failure is not None:
            raise EngineFailedError("the engine loop failed") from self.engine_loop.failure
        self.mover.watch()
        tracer = telemetry.tracer("prefix-serve-replica") if request.trace_parent else None
        arrived = time.monotonic()
        pulled, waited = await self._admit(request, traced=tracer is not None)
        loop = asyncio.get_running_loop()
        rid = request.request_id
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.engine_loop.streams[rid] = queue
        self.engine_loop.wake()
        self.mover.arrived(rid)  # routed here as this replica leaves: it goes on elsewhere
        unfinished = request.params.n  # the stream ends when every choice has
        finished = False
        last: RequestOutput | None = None
        emitted = 0  # tokens of choice 0 streamed
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, RequestFailedError):  # this request alone
                    raise item
                if isinstance(item, BaseException):
                    raise EngineFailedError("the engine loop failed") from item
                unfinished -= item.finished
                finished = unfinished == 0 or item.moved is not None  # moved: it ends here
                if item.index == 0:
                    if emitted == 0 and pulled is not None:
                        item = replace(item, num_pulled_tokens=pulled.tokens)
                    emitted += len(item.new_token_ids)
                    last = item
                yield replace(item, times=None) if item.times is not None else item
        finally:
            self.engine_loop.streams.pop(rid, None)
            if not finished:  # cancelled or disconnected: free its blocks (not awaited)
                loop.run_in_executor(self._executor, self.engine.abort_request, rid)
            if tracer is not None:
                stay = (arrived, time.monotonic())
                ended = last if last is not None and last.finished else None
                record_replica_spans(
                    tracer, request, self.replica_id, stay, pulled, waited, ended, emitted
                )

    async def _admit(
        self, request: EngineRequest, traced: bool
    ) -> tuple[PullOutcome | None, tuple[float, float]]:
        """Compile its grammar, pull its prefix, add it to the engine. Returns the pull's
        outcome, and when the add was handed to the engine's thread and when that thread
        took it (between them: the rest of the step it was running)."""
        loop = asyncio.get_running_loop()
        add = functools.partial(
            self.engine.add_request,
            request.request_id,
            request.prompt_token_ids,
            request.params,
            cache_salt=request.cache_salt,
            output_token_ids=request.output_token_ids,
            retention=request.retention,
            owner=request.owner,
            traced=traced,
        )
        structured = request.params.structured
        if structured is not None:  # compiled (once per schema) off the engine's thread
            await loop.run_in_executor(None, self.engine.grammars.compile, structured)
        pulled = await self.puller.before_admission(request)
        submitted = time.monotonic()
        began = await loop.run_in_executor(self._executor, timed, add)
        return pulled, (submitted, began)

    async def export_prefix(self, request: PullRequest) -> PrefixExport:
        """This replica's verified cached prefix of another replica's prompt (between steps,
        on the engine's thread)."""
        from replica.kv.transfer import export_prefix

        by_reference = request.node_id == self.node_id and self.args.pull.shared_memory
        return await self._on_engine(
            export_prefix,
            self.engine.kv,
            request.prompt_token_ids,
            request.cache_salt,
            by_reference,
        )

    async def accept_kv(self, push: KVPush) -> str:
        """Import KV another replica hands on (a moved stream's, a leaving replica's hot
        prefix), verified like a pull; this replica's id (``replica.moves``)."""
        from replica.kv.transfer import import_prefix

        self.mover.watch()
        result = await self._on_engine(
            import_prefix, self.engine.kv, push.token_ids, push.cache_salt, push.export
        )
        self.mover.received(result.imported)
        return self.replica_id

    async def move_streams(self, order: MoveOrder) -> list[Move]:
        """Move streams off this replica now (an operator's order, ``MoveOrder``)."""
        self.mover.watch()
        return await self.mover.move_many(
            order.to, order.max_streams, order.reason, order.push_timeout_s
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
            "in_flight": len(self.engine_loop.streams),
            **publisher.routing_stats(self.publisher.in_sync),
            "epoch": self.publisher.epoch,
            "pid": os.getpid(),
            "node_id": self.node_id,
            "rss_mb": process.rss_mb(),
            **self.puller.counters.to_dict(),
            **self.mover.counters.to_dict(),
            **self._store_stats(),
            "idle_audits": self.engine_loop.audits,
            "audit_error": self.engine_loop.audit_error,
        }

    def _store_stats(self) -> dict[str, Any]:
        if self.tier is None:
            return {}
        leading = self.store_publisher is not None and self.store_publisher.leading
        return {**self.tier.stats(), "store_publisher": leading}

    def check_health(self) -> None:
        if self.engine_loop.failure is not None:
            raise EngineFailedError("the engine loop failed") from self.engine_loop.failure

    async def __del__(self) -> None:
        """Serve's graceful stop (Ctrl-C, scale-down, redeploy), after the replica's
        running requests finished (or moved: ``replica.moves``) or its graceful-shutdown
        timeout passed."""
        self._leave_index()  # first: a replica stopping with it sees this one gone
        await self.mover.finish(self._others_in_index)  # the hot prefixes' hand-off
        self.engine_loop.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _others_in_index(self) -> bool:
        """Whether another replica of this deployment is still in the index (Redis down:
        assumed so; the hand-off's own bound still holds)."""
        try:
            live = await asyncio.to_thread(self.puller.reader.live_replicas)
        except RedisError:
            return True
        return any(rid != self.replica_id for rid in live)

    def _leave_index(self) -> None:
        """Deregister (once). Also at interpreter exit: a SIGTERM to ``serve run`` (what
        systemd, Kubernetes and ``docker stop`` send) makes Ray SIGTERM its workers, whose
        handler exits the interpreter without ``__del__``; ``atexit`` still runs."""
        if not self._left:
            self._left = True
            self.publisher.close(deregister=True)
            store = self.tier.store if self.tier is not None else None
            last = bool(getattr(store, "leave", lambda: False)())  # the node's last replica
            if self.store_publisher is not None:
                leading = self.store_publisher.leading
                self.store_publisher.close(last=last)
                log.info("left the index (node store: last user %s, publisher %s)", last, leading)
            if self.tier is not None:
                self.tier.wait_idle(2.0)  # its mapping stays: steps may still run
