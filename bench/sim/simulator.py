"""A discrete-event simulation of the cluster, for more replicas than one machine holds.

Each simulated replica is the real ``replica.engine.Engine`` (scheduler, block manager,
prefix cache, allocator, metrics, events) with the model replaced by a calibrated cost model
(``cost_model``) and wall time by a virtual clock. Routing is the real ``router.core``
(the very calls the Serve router makes, with our policies or the peers' models); the index
is an in-memory copy of the Redis index's semantics (``bench.sim.index``: published blocks
from the same engine events, bookings and predicted blocks from the routing decisions). Like
Serve, a replica takes at most ``max_ongoing_requests``; the rest wait, in order, for the
first free slot among the replicas the policy ranked.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from bench.loadgen import RequestResult
from bench.sim.cost_model import Clock, CostModel, CostRunner
from bench.sim.index import SimIndex
from bench.workloads import TraceRequest
from kvindex.records import RoutingRequest
from replica.checkpoints import checkpoint_for
from replica.config import EngineConfig
from replica.engine import Engine
from replica.messages import RequestOutput
from replica.sampling.params import SamplingParams
from router.core import RoutingCore
from router.policies import RoutingPolicy


@dataclass(frozen=True)
class _Pending:
    """A request that arrived: tokenized and hashed once, placed when a slot frees up."""

    request: TraceRequest
    route: RoutingRequest
    token_ids: list[int]


@dataclass
class SimReplica:
    replica_id: str
    engine: Engine
    clock: Clock
    stepping: bool = False


class Simulation:
    """Replays a trace through ``num_replicas`` simulated replicas under one policy."""

    def __init__(
        self,
        policy: RoutingPolicy,
        num_replicas: int,
        config: EngineConfig,
        cost: CostModel,
        max_ongoing_requests: int = 32,
        affinity_blocks: int = 4,
        predict_ttl_s: float = 5.0,
    ) -> None:
        self.core = RoutingCore(policy)
        self.config = config
        self.hasher = config.block_hasher()
        self.tokenizer = checkpoint_for(config.model).tokenizer()
        self.max_ongoing = max_ongoing_requests
        self.affinity_blocks = affinity_blocks
        self.index = SimIndex(predict_ttl_s)
        self.replicas: dict[str, SimReplica] = {}
        for i in range(num_replicas):
            rid = f"sim-{i:04d}"
            clock = Clock()
            engine = Engine(
                config, runner=CostRunner(cost, clock, config.shape.vocab_size), clock=clock
            )
            engine.subscribe(self.index.listener(rid))
            self.replicas[rid] = SimReplica(rid, engine, clock)

    def reset(self, trace: Sequence[TraceRequest]) -> None:
        """Empty queues and a result slot for each request of ``trace`` (``run`` starts so)."""
        self._events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self._waiting: deque[_Pending] = deque()
        self._results = {r.request_id: RequestResult(r.request_id, r.group, 200) for r in trace}
        self._arrival = {r.request_id: r.arrival_s for r in trace}
        self._last_token: dict[str, float] = {}

    def run(self, trace: Sequence[TraceRequest]) -> tuple[list[RequestResult], float]:
        """Results in trace order, and the makespan (simulated seconds)."""
        self.reset(trace)
        for req in trace:
            self._push(req.arrival_s, "arrive", req)
        now = 0.0
        while self._events:
            now, _, kind, item = heapq.heappop(self._events)
            if kind == "arrive":
                assert isinstance(item, TraceRequest)
                self._arrive(item, now)
            else:
                self._step(self.replicas[str(item)], now)
        makespan = max((r.clock.now for r in self.replicas.values()), default=now)
        return [self._results[r.request_id] for r in trace], makespan

    def _push(self, t: float, kind: str, item: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, item))

    def _arrive(self, req: TraceRequest, now: float) -> None:
        """Tokenize and hash once, then place the request, or queue it behind the others."""
        ids = req.token_ids(self.tokenizer)
        chain = self.hasher.chain(ids)
        key = self.hasher.affinity_key(ids, self.affinity_blocks, chain=chain)
        route = RoutingRequest(
            req.request_id, chain, key, len(ids), self.hasher.block_size, req.max_tokens
        )
        pending = _Pending(req, route, ids)
        if self._waiting or not self._place(pending, now):
            self._waiting.append(pending)

    def _step(self, replica: SimReplica, now: float) -> None:
        """One engine step on ``replica``; a finished request frees a slot for the queue."""
        replica.clock.now = now
        finished = False
        for out in replica.engine.step():
            finished |= self._record(out, replica.clock.now)
        if replica.engine.has_unfinished_requests():
            self._push(replica.clock.now, "step", replica.replica_id)
        else:
            replica.stepping = False
        if finished:
            while self._waiting and self._place(self._waiting[0], replica.clock.now):
                self._waiting.popleft()

    def _place(self, pending: _Pending, t: float) -> bool:
        """Send a request to the best-ranked replica with a free slot, as Serve would, and
        book it there as the Serve router does (the same core calls)."""
        route, ids = pending.route, list(self.replicas)
        answer = None
        if self.core.policy.uses_index:
            answer = self.index.query(route.block_hashes, ids, t)
        decision = self.core.decide(route, self.core.states(ids, answer, route.block_hashes))
        for rid in decision.ranking:
            replica = self.replicas[rid]
            if replica.engine.num_unfinished >= self.max_ongoing:
                continue
            self.index.book(self.core.routed(decision, rid), t)
            self.core.acknowledged(route.request_id)
            req = pending.request
            params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
            replica.engine.add_request(req.request_id, pending.token_ids, params, arrival_time=t)
            self._results[req.request_id].replica = rid
            if not replica.stepping:
                replica.stepping = True
                self._push(max(t, replica.clock.now), "step", rid)
            return True
        return False

    def engine_hit_rate(self) -> float:
        prompt = sum(r.engine.metrics.prompt_tokens for r in self.replicas.values())
        cached = sum(r.engine.metrics.cached_prompt_tokens for r in self.replicas.values())
        return cached / prompt if prompt else 0.0

    def _record(self, out: RequestOutput, t: float) -> bool:
        result = self._results[out.request_id]
        arrival = self._arrival[out.request_id]
        if out.request_id not in self._last_token:
            self.core.prefill_done(out.request_id)
            self.index.prefill_done(out.request_id)
            result.ttft_s = t - arrival
            result.prompt_tokens = out.num_prompt_tokens
            result.cached_tokens = out.num_cached_tokens
        else:
            result.itl_s.append(t - self._last_token[out.request_id])
        self._last_token[out.request_id] = t
        result.completion_tokens = len(out.token_ids)
        if out.finished:
            self.core.release(out.request_id)
            self.index.release(out.request_id)
            result.latency_s = t - arrival
        return out.finished
