"""A discrete-event simulation of the cluster, for more replicas than one machine holds.

Each simulated replica is the real ``replica.engine.Engine`` (scheduler, block manager,
prefix cache, allocator, metrics, events) with the model replaced by a calibrated cost model
(``cost_model``) and wall time by a virtual clock. Routing is the real ``router.core``
(the very calls the Serve router makes, with our policies or the peers' models); the index
is an in-memory copy of the Redis index's semantics (``bench.sim.index``: published blocks
from the same engine events, bookings and predicted blocks from the routing decisions). Like
Serve, a replica takes at most ``max_ongoing_requests``; the rest wait, in order, for the
first free slot among the replicas the policy ranked.

With pulls (``pull``), a replica given a request looks the prompt up in the index as a real
replica does and, by the same rule (``kvindex.pulls.pull_source``), pulls the blocks another
replica has published: the real ``export_prefix`` and ``import_prefix`` move the blocks'
metadata (the cost model's one-byte stand-in for their KV), and the request is admitted
after the cost model's pull time, holding its slot meanwhile.

With node stores (``store``, ``store_blocks``), every ``replicas_per_node`` replicas share
one real ``replica.store.NodeStore`` of ``store_blocks`` slots (one byte of "KV" each, as
the pools): released blocks spill into it and a request's stored blocks are restored
before admission, by the engine's own tier code; a restored block costs the engine's
thread ``CostModel.store_block_s``. The store's entry in the index follows its events,
and the routing core credits it to the node's replicas (``kvindex.stored``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from bench.loadgen import RequestResult
from bench.sim.cost_model import Clock, CostModel, CostRunner, no_drafts
from bench.sim.index import SimIndex
from bench.workloads import TraceRequest
from kvindex.pulls import PullPrices, pull_source
from kvindex.records import RoutingRequest, store_id
from kvindex.stored import StorePrices
from replica.checkpoints import checkpoint_for
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.kv.transfer import PrefixExport, export_prefix, import_prefix
from replica.messages import RequestOutput
from replica.sampling.params import SamplingParams
from replica.store.layout import StoreGeometry
from replica.store.node_store import NodeStore
from replica.store.tier import StoreTier
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
    runner: CostRunner
    stepping: bool = False
    pulling: int = 0  # requests given to it, admitted when their pull is done

    @property
    def busy_slots(self) -> int:
        return self.engine.num_unfinished + self.pulling


@dataclass
class PullTally:
    pulls: int = 0
    pulled_blocks: int = 0
    pull_s: float = 0.0
    restored_blocks: int = 0  # from node stores


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
        pull: PullPrices | None = None,
        store: StorePrices | None = None,
        store_blocks: int = 0,
        replicas_per_node: int = 8,
    ) -> None:
        self.pull = pull if pull is not None and pull.enabled else None
        self.store = store if store is not None and store.enabled and store_blocks else None
        self.cost = cost
        self.tally = PullTally()
        self.core = RoutingCore(policy, pulls=self.pull, stores=self.store)
        config = no_drafts(config)  # the cost model prices one token per decode
        self.config = config
        self.hasher = config.block_hasher()
        self.tokenizer = checkpoint_for(config.model).tokenizer()
        self.max_ongoing = max_ongoing_requests
        self.affinity_blocks = affinity_blocks
        self.index = SimIndex(predict_ttl_s)
        self.replicas: dict[str, SimReplica] = {}
        self.nodes: dict[str, str] = {}  # replica -> its node
        self.stores: dict[str, NodeStore] = {}  # node -> its store
        for i in range(num_replicas):
            rid = f"sim-{i:04d}"
            clock = Clock()
            runner = CostRunner(cost, clock, config.shape.vocab_size, config.num_blocks)
            engine = Engine(config, runner=runner, clock=clock)
            engine.subscribe(self.index.listener(rid))
            self.nodes[rid] = f"node-{i // replicas_per_node:04d}"
            if self.store is not None:
                self._attach_store(engine, self.nodes[rid], store_blocks)
            self.replicas[rid] = SimReplica(rid, engine, clock, runner)
        self._entries = [*self.replicas, *(store_id(n) for n in self.stores)]

    def _attach_store(self, engine: Engine, node: str, store_blocks: int) -> None:
        assert self.store is not None
        if node not in self.stores:
            ways = self.store.ways
            geometry = StoreGeometry(self.config.block_size, 1, max(1, store_blocks // ways), ways)
            self.stores[node] = NodeStore.anonymous(geometry)
        tier = StoreTier(self.stores[node], background=False)
        tier.listeners.append(self.index.listener(store_id(node)))
        engine.attach_store(tier)

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
            elif kind == "admit":
                assert isinstance(item, tuple)
                self._admit(*item, now)
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
            answer = self.index.query(route.block_hashes, self._entries, t)
        nodes = self.nodes if self.store is not None else None
        states = self.core.states(ids, answer, route.block_hashes, nodes=nodes)
        decision = self.core.decide(route, states)
        for rid in decision.ranking:
            replica = self.replicas[rid]
            if replica.busy_slots >= self.max_ongoing:
                continue
            self.index.book(self.core.routed(decision, rid), t)
            self.core.acknowledged(route.request_id)
            self._results[pending.request.request_id].replica = rid
            export = self._export(pending, rid, t) if self.pull else None
            if export is None:
                self._admit(replica, pending, None, t)
            else:  # the pull's blocks arrive, and the request is admitted, later
                replica.pulling += 1
                pull_s = self.cost.pull_time(len(export.blocks))
                self.tally.pull_s += pull_s
                self._push(t + pull_s, "admit", (replica, pending, export))
            return True
        return False

    def _export(self, pending: _Pending, rid: str, t: float) -> PrefixExport | None:
        """What ``rid`` pulls for the request, as a real replica decides it (the index's
        answer, ``pull_source``); the holder's engine thread pays its half of the copy."""
        assert self.pull is not None
        chain = pending.route.block_hashes
        if len(chain) < self.pull.min_blocks:
            return None
        answer = self.index.query(chain, self._entries, t)
        own_store = store_id(self.nodes[rid]) if self.store is not None else ""
        source = pull_source(answer, rid, self.pull.min_blocks, own_store)
        if source is None:
            return None
        holder = self.replicas[source]
        export = export_prefix(holder.engine.kv, pending.token_ids, None)
        holder.runner.owed_s += self.cost.pull_block_s * len(export.blocks) / 2
        return export

    def _admit(
        self, replica: SimReplica, pending: _Pending, export: PrefixExport | None, t: float
    ) -> None:
        """Import what was pulled (verified), then hand the request to the engine."""
        if export is not None:
            replica.pulling -= 1
            result = import_prefix(replica.engine.kv, pending.token_ids, None, export)
            replica.runner.owed_s += self.cost.pull_block_s * len(export.blocks) / 2
            self.tally.pulls += 1
            self.tally.pulled_blocks += result.imported
        req = pending.request
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        tier = replica.engine.store
        restored = tier.counters.restored_blocks if tier is not None else 0
        replica.engine.add_request(req.request_id, pending.token_ids, params, arrival_time=t)
        if tier is not None:  # the restore's copies, on the engine's thread
            restored = tier.counters.restored_blocks - restored
            self.tally.restored_blocks += restored
            replica.runner.owed_s += self.cost.store_block_s * restored
        if not replica.stepping:
            replica.stepping = True
            self._push(max(t, replica.clock.now), "step", replica.replica_id)

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
