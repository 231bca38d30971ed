"""A discrete-event simulation of the cluster, for more replicas than one machine holds.

Each simulated replica is the real ``replica.engine.Engine`` (scheduler, block manager,
prefix cache, allocator, metrics, events) with the model replaced by a calibrated cost model
and wall time by a virtual clock. Routing uses the real ``router.policies`` classes; the
index is an in-memory copy of the Redis index's semantics (hash -> replicas, fed by the same
engine events, queried for each replica's leading run of the chain). Like Serve, a replica
takes at most ``max_ongoing_requests``; the rest wait, in order, for the first free slot.
"""

from __future__ import annotations

import heapq
import itertools
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from cluster.experiments.loadgen import RequestResult
from cluster.experiments.workloads import TraceRequest
from replica.checkpoints import checkpoint_for
from replica.config import EngineConfig
from replica.engine import Engine, RequestOutput
from replica.model_runner import ModelRunner
from replica.prefix_cache import CacheEvents
from replica.sampling_params import SamplingParams
from replica.scheduler import ScheduledBatch
from router.policies import ReplicaLoad, RoutingPolicy, RoutingRequest


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step: ``base + prefill_token x P + decode_seq x D``, where P is
    the step's prefill (uncached) tokens and D its decoding sequences."""

    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    measured: str = ""

    def step_time(self, batch: ScheduledBatch) -> float:
        return (
            self.base_s
            + self.prefill_token_s * batch.num_prefill_tokens
            + self.decode_seq_s * batch.num_decodes
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls(**json.loads(Path(path).read_text()))


DEFAULT_CALIBRATION = Path(__file__).with_name("calibration.json")


def calibrate(config: EngineConfig, seed: int = 0) -> CostModel:
    """Fit the cost model to step times of the real engine on a mixed workload."""

    class Timed:
        def __init__(self) -> None:
            self.real = ModelRunner(config)
            self.samples: list[tuple[int, int, float]] = []

        def execute(self, batch: ScheduledBatch) -> torch.Tensor:
            t0 = time.perf_counter()
            logits = self.real.execute(batch)
            elapsed = time.perf_counter() - t0
            self.samples.append((batch.num_prefill_tokens, batch.num_decodes, elapsed))
            return logits

    runner = Timed()
    engine = Engine(config.model_copy(update={"enable_prefix_cache": False}), runner=runner)
    rng = np.random.default_rng(seed)
    for round_ in range(6):  # waves of varied prompt lengths and batch sizes
        n = int(rng.integers(1, 24))
        prompts = [rng.integers(0, 256, int(rng.integers(8, 700))).tolist() for _ in range(n)]
        engine.generate(
            prompts, SamplingParams(max_tokens=int(rng.integers(8, 40)), ignore_eos=True)
        )
        if round_ == 0:
            runner.samples.clear()  # the first wave warms torch up
    x = np.array([[1.0, p, d] for p, d, _ in runner.samples])
    y = np.array([t for _, _, t in runner.samples])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    base, per_token, per_seq = (max(float(c), 0.0) for c in coef)
    stamp = f"{len(y)} steps, torch {torch.__version__}, {torch.get_num_threads()} threads"
    return CostModel(base, per_token, per_seq, f"{stamp}, {time.strftime('%F')}")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _CostRunner:
    """Stands in for the model: advances the replica's clock by the step's modelled cost."""

    def __init__(self, cost: CostModel, clock: _Clock, vocab: int) -> None:
        self.cost, self.clock, self.vocab = cost, clock, vocab

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.clock.now += self.cost.step_time(batch)
        return torch.zeros(sum(batch.samples), self.vocab)


class SimIndex:
    """The Redis index's semantics in memory: fed by engine events, queried like ``query``."""

    def __init__(self) -> None:
        self.holders: dict[bytes, set[str]] = {}

    def listener(self, replica_id: str):
        def apply(events: CacheEvents) -> None:
            for h in events.removed:
                held = self.holders.get(h)
                if held is not None:
                    held.discard(replica_id)
            for h in events.stored:
                self.holders.setdefault(h, set()).add(replica_id)

        return apply

    def query(self, chain: Sequence[bytes], replica_ids: Sequence[str]) -> dict[str, int]:
        answer = dict.fromkeys(replica_ids, len(chain))
        alive = set(replica_ids)
        for i, h in enumerate(chain):
            if not alive:
                break
            held = self.holders.get(h, set())
            for rid in alive - held:
                answer[rid] = i
            alive &= held
        return answer


@dataclass(frozen=True)
class _Pending:
    """A request that arrived: tokenized and hashed once, placed when a slot frees up."""

    request: TraceRequest
    routing: RoutingRequest
    token_ids: list[int]


@dataclass
class SimReplica:
    replica_id: str
    engine: Engine
    clock: _Clock
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
    ) -> None:
        self.policy = policy
        self.config = config
        self.hasher = config.block_hasher()
        self.tokenizer = checkpoint_for(config.model).tokenizer()
        self.max_ongoing = max_ongoing_requests
        self.affinity_blocks = affinity_blocks
        self.index = SimIndex()
        self.replicas: dict[str, SimReplica] = {}
        for i in range(num_replicas):
            rid = f"sim-{i:04d}"
            clock = _Clock()
            engine = Engine(
                config, runner=_CostRunner(cost, clock, config.shape.vocab_size), clock=clock
            )
            engine.subscribe(self.index.listener(rid))
            self.replicas[rid] = SimReplica(rid, engine, clock)

    def run(self, trace: Sequence[TraceRequest]) -> tuple[list[RequestResult], float]:
        """Results in trace order, and the makespan (simulated seconds)."""
        self._events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self._waiting: deque[_Pending] = deque()
        self._results = {r.request_id: RequestResult(r.request_id, r.group, 200) for r in trace}
        self._arrival = {r.request_id: r.arrival_s for r in trace}
        self._last_token: dict[str, float] = {}
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
        pending = _Pending(req, RoutingRequest(chain, key, len(ids), self.hasher.block_size), ids)
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
        """Send a request to the best-ranked replica with a free slot, as Serve would."""
        loads = [
            ReplicaLoad(rid, r.engine.scheduler.num_unfinished) for rid, r in self.replicas.items()
        ]
        answer = (
            self.index.query(pending.routing.block_hashes, list(self.replicas))
            if self.policy.name == "cache_aware"
            else None
        )
        for rid in self.policy.rank(pending.routing, loads, answer):
            replica = self.replicas[rid]
            if replica.engine.scheduler.num_unfinished >= self.max_ongoing:
                continue
            self.policy.on_routed(rid)
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
            result.ttft_s = t - arrival
            result.prompt_tokens = out.num_prompt_tokens
            result.cached_tokens = out.num_cached_tokens
        else:
            result.itl_s.append(t - self._last_token[out.request_id])
        self._last_token[out.request_id] = t
        result.completion_tokens = len(out.token_ids)
        if out.finished:
            result.latency_s = t - arrival
        return out.finished
