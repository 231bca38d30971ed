"""``VLLMReplica``: the Ray Serve deployment of ``engine.backend: vllm``.

vLLM's ``AsyncLLM`` runs in the replica's process (its engine core and model worker in child
processes it starts), as Ray Serve LLM's ``LLMServer`` runs it. The replica answers the same
calls as ``EngineReplica`` (``generate``, the routing stats, the health check), subscribes to
its vLLM's KV events and publishes them to the index under our hash chain
(``replica.vllm``), heartbeats there, and deregisters when it stops. It has no
``export_prefix``: pulls and the node store hold the native engine's blocks only.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray import serve

from kvindex.writer import IndexWriter
from replica.args import ReplicaArgs
from replica.config import EngineConfig
from replica.errors import InvalidRequestError
from replica.messages import EngineRequest, RequestOutput
from replica.publisher import IndexPublisher

if TYPE_CHECKING:  # vLLM loads in the replica's process only
    from replica.vllm.engine import VLLMEngine
    from replica.vllm.events import EventSubscriber

log = logging.getLogger("ray.serve")
# tests only: sequence numbers of KV event batches the subscriber throws away on arrival
DROP_EVENTS_ENV = "PREFIX_SERVE_TEST_DROP_KV_EVENTS"


class VLLMEngineFailedError(RuntimeError):
    """vLLM's engine died; the replica reports unhealthy and Serve replaces it."""


@serve.deployment(max_ongoing_requests=32)
class VLLMReplica:
    async def __init__(self, args: dict[str, Any] | ReplicaArgs) -> None:
        from replica.vllm.bridge import KVEventBridge
        from replica.vllm.engine import EventEndpoints, VLLMEngine
        from replica.vllm.events import EventSubscriber

        self.args = ReplicaArgs.model_validate(args)
        config = self.args.engine
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.in_flight = 0
        self._left = False
        self._loop = asyncio.get_running_loop()
        self._events_dir = Path(tempfile.mkdtemp(prefix="prefix-serve-kv-events-"))
        endpoints = EventEndpoints.in_dir(self._events_dir)
        self.publisher = IndexPublisher(
            IndexWriter(self.args.index, config.model_id),
            self.replica_id,
            stats=self.record_routing_stats,
        )
        bridge = KVEventBridge(config.block_hasher(), self.publisher.on_events)
        drops = [int(s) for s in os.environ.get(DROP_EVENTS_ENV, "").split(",") if s.strip()]
        self.subscriber: EventSubscriber = EventSubscriber(
            bridge, endpoints.publish, endpoints.replay, self._on_lost, drop=drops
        ).start()  # connected before vLLM binds: ZMQ reconnects, no batch is missed
        _bind_threads(config)
        self.engine: VLLMEngine = VLLMEngine(config, endpoints)
        atexit.register(self._leave)
        self.publisher.start()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; a cancelled stream aborts it in vLLM (its
        ``generate`` does that when the iteration stops early)."""
        self.check_health_now()
        self.in_flight += 1
        try:
            async for output in self.engine.generate(request):
                yield output.streamed(self.replica_id)
        except ValueError as exc:  # vLLM's input checks (too long a prompt, a bad param)
            raise InvalidRequestError(str(exc)) from None
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and not self.subscriber.strict:
                self._loop.create_task(self._reset_cache())

    def _on_lost(self) -> None:
        """The subscriber lost events it could not replay (its thread): reset vLLM's cache,
        so that both start again from empty."""
        asyncio.run_coroutine_threadsafe(self._reset_cache(), self._loop)

    async def _reset_cache(self) -> None:
        """vLLM refuses while requests run; then the next idle moment tries again."""
        if not self.subscriber.strict and await self.engine.reset_prefix_cache():
            log.info("vLLM's prefix cache reset after lost KV events")

    def record_routing_stats(self) -> dict[str, Any]:
        """The native replica's stats names, with what vLLM and the bridge know."""
        bridge = self.subscriber.bridge
        counters = self.publisher.counters
        return {
            **self.engine.counters.stats(
                self.in_flight, self.engine.num_blocks, len(bridge.ours), bridge.counters.removed
            ),
            "backend": "vllm",
            "replica_id": self.replica_id,
            "time": time.time(),
            "in_flight": self.in_flight,
            "index_in_sync": self.publisher.in_sync and self.subscriber.strict,
            "index_failures": counters.failures,
            "index_resyncs": counters.resyncs,
            "index_dropped_batches": counters.dropped_batches,
            "index_overflows": counters.overflows,
            "epoch": self.publisher.epoch,
            "pid": os.getpid(),
            "node_id": self.node_id,
            "unkeyable_blocks": bridge.counters.unkeyable,
            **self.subscriber.counters.to_dict(),
        }

    def check_health_now(self) -> None:
        if self.engine.llm.errored:
            raise VLLMEngineFailedError("vLLM's engine died")
        if not self.subscriber.alive:
            raise VLLMEngineFailedError("the KV event subscriber stopped")

    async def check_health(self) -> None:
        self.check_health_now()
        await self.engine.llm.check_health()

    async def __del__(self) -> None:
        """Serve's graceful stop: after the running requests finished (or the timeout)."""
        self._leave()

    def _leave(self) -> None:
        """Deregister from the index, stop the subscriber and vLLM (once; also at exit)."""
        if self._left:
            return
        self._left = True
        self.publisher.close(deregister=True)
        self.subscriber.close()
        self.engine.shutdown()
        shutil.rmtree(self._events_dir, ignore_errors=True)


def _bind_threads(config: EngineConfig) -> None:
    """vLLM's OpenMP threads: ``num_threads`` (default: the replica's CPUs, rounded up),
    bound to CPUs of their own picked by the replica's rank, as vLLM's CPU docs ask; where
    the machine has fewer CPUs than the replicas want, unbound."""
    threads = config.num_threads
    if threads is None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        threads = max(1, math.ceil(cpus))
    allowed = sorted(os.sched_getaffinity(0))
    rank = serve.get_replica_context().rank
    rank = int(getattr(rank, "rank", rank) or 0)
    first = rank * threads
    if first + threads <= len(allowed):
        cores = allowed[first : first + threads]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = str(threads)
