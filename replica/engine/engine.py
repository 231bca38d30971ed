"""The offline engine: ``add_request`` / ``step`` for streaming, ``generate`` for batches.

No Ray here: the Serve replica (``replica.deployment``) drives this class from its loop. A
request whose own sampling or bookkeeping fails is dropped with ``finish_reason`` "error"
(``_fail``: its blocks freed, the step and every other request go on); a step that fails as
a whole is a bug the replica reports.

Longer than 300 lines because it is the engine's one face (requests, the step and what it
hands back, runs to completion, events, introspection), which tests, the replica and the
simulator all drive; the step's parts live in their own modules (scheduler, block manager,
sampler, choices).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import abc
from collections.abc import Callable

import torch

from replica.checkpoints import checkpoint_for
from replica.config import EngineConfig
from replica.engine.blocks.audit import check_block_accounting
from replica.engine.blocks.manager import BlockManager
from replica.engine.blocks.prefix_cache import CacheEvents
from replica.engine.choices import fork_choices
from replica.engine.drafts import Drafter
from replica.engine.faces import KVHandle, KVPool, SecondTier
from replica.engine.limits import check_request
from replica.engine.scheduler import Scheduler
from replica.engine.sequence import Sequence, SequenceStatus
from replica.engine.speculation import verify
from replica.engine.stats import EngineMetrics, EngineStats
from replica.engine.step import Runner, ScheduledBatch
from replica.errors import InvalidRequestError
from replica.messages import Owner, RequestOutput, Retention
from replica.sampling.grammar import Grammars
from replica.sampling.params import SamplingParams
from replica.sampling.sampler import Sample, Sampler

log = logging.getLogger("ray.serve")


class Engine:
    """A paged engine with a verified local prefix cache and continuous batching.

    It is handed its ``runner``: the model (``replica.model.runner.build_engine`` builds an
    engine with one) or the simulator's cost model, which with a virtual ``clock`` runs this
    very scheduler, cache and accounting.
    With a node store (``attach_store``), released blocks spill there behind each step and
    a request's stored prefix is restored when it is added (``replica.store``).
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.hasher = config.block_hasher()
        self.block_manager = BlockManager(
            config.num_blocks,
            config.block_size,
            self.hasher,
            config.enable_prefix_cache,
            config.protected_fraction,
            config.max_pinned_fraction,
            config.tenant_kv_shares,
        )
        self.drafter = Drafter(config.speculation) if config.speculation.enabled else None
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.decode_reserve,
            config.priority_prefill,
            self.drafter,
        )
        self.runner = runner
        # its blocks as KV moves between engines and tiers (``faces.KVHandle``); a runner
        # keeps a pool as ``kv_cache`` (the model's, the simulator's one byte a block) or,
        # a test's stand-in, none
        pool: KVPool | None = getattr(runner, "kv_cache", None)
        self.kv: KVHandle | None = None
        if pool is not None:  # evictions bump the pool's own counters (what a peer reads)
            self.block_manager.allocator.generations = pool.generations
            self.kv = KVHandle(self.block_manager, pool)
        self.clock = clock
        self.store: SecondTier | None = None  # the second cache tier (``attach_store``)
        self._eos_token_ids = frozenset(config.shape.eos_token_ids)
        self.sampler = Sampler(config.seed, config.shape.eos_token_ids)
        self.grammars = Grammars(
            lambda: checkpoint_for(config.model).tokenizer(),
            config.shape.vocab_size,
            tuple(config.shape.eos_token_ids),
        )
        self.metrics = EngineMetrics()
        self._seqs: dict[str, Sequence] = {}
        self._choices: dict[str, list[str]] = {}  # request -> its choices 1..n-1
        self._listeners: list[Callable[[CacheEvents], None]] = []
        self._ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: abc.Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        output_token_ids: abc.Sequence[int] = (),
        retention: Retention | None = None,
        owner: Owner | None = None,
        traced: bool = False,
    ) -> None:
        """Queue a request. Raises ``InvalidRequestError`` if it can never be served.

        ``output_token_ids`` resumes a request that produced them elsewhere (its replica
        died): they are computed like the prompt (and hit the prefix cache where they can),
        but count as output, so generation, ``max_tokens`` and the sampler's positions go
        on exactly where they stopped. ``retention`` keeps its blocks for its session's next
        turn once it finishes (``replica.engine.blocks.retention``). ``owner``: the tenant
        whose share of the pool its blocks count in (``replica.engine.blocks.eviction``),
        and the request's priority (``replica.engine.scheduler``). ``traced``: time its
        restore and prompt chunks for its replica's spans (``RequestOutput.times``)."""
        params = params or SamplingParams()
        tokens, outputs = list(prompt_token_ids), list(output_token_ids)
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_request(self.config, tokens, params, outputs)
        grammar = None
        if params.structured is not None:
            grammar = self.grammars.state(params.structured, self.config.shape.vocab_size)
            for token in outputs:  # resuming: where the grammar was when the replica died
                grammar.accept(token)
        seq = Sequence(
            request_id,
            tokens + outputs,
            params,
            cache_salt,
            self.clock() if arrival_time is None else arrival_time,
        )
        seq.num_prompt_tokens = len(tokens)
        seq.grammar = grammar
        seq.retention = retention
        if self.drafter is not None and params.speculate:
            seq.drafts = self.drafter.new_state()
        if owner is not None:
            seq.tenant, seq.priority = owner.tenant, owner.priority
            self.block_manager.allocator.cached.set_weight(owner.tenant, owner.weight)
        if traced:
            seq.chunk_times = []
        if self.store is not None and params.prompt_logprobs is None:
            started = time.perf_counter()
            seq.num_restored_tokens = self.store.restore(self.kv, seq) * self.kv.block_size
            seq.restore_s = time.perf_counter() - started
        self.block_manager.expect(seq)  # what it will hit outlives the prefills queued ahead
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Drop a queued or running request (all its choices) and free its blocks. False if
        unknown."""
        for choice in self._choices.pop(request_id, []):
            self.abort_request(choice)
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.metrics.num_aborted += 1
        return True

    def movable(self, decoding: bool = False) -> list[tuple[str, int]]:
        """Requests another replica could continue (one choice each, not yet finished; with
        ``decoding``, only those past their first token), with the output tokens each has
        left, the most first (``replica.moves``)."""
        left = [
            (rid, seq.params.max_tokens - seq.num_output_tokens)
            for rid, seq in self._seqs.items()
            if rid == seq.parent_id and rid not in self._choices and seq.params.n == 1
            if not decoding or seq.num_output_tokens > 0
        ]
        return sorted(left, key=lambda item: -item[1])

    def detach(self, request_id: str) -> tuple[list[int], str | None] | None:
        """Stop a movable request here and return its tokens (prompt and output so far) and
        its salt: its full blocks stay cached, for an export (None: not movable)."""
        seq = self._seqs.get(request_id)
        if seq is None or request_id in self._choices or seq.params.n != 1:
            return None
        token_ids, salt = list(seq.token_ids), seq.cache_salt
        self.abort_request(request_id)
        self.metrics.num_aborted -= 1  # moved, not aborted
        return token_ids, salt

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    @property
    def num_unfinished(self) -> int:
        """Sequences waiting or running (a request with n choices counts n once forked)."""
        return self.scheduler.num_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that got a token."""
        self.block_manager.pins.expire()  # before scheduling: what it frees is available
        batch = self.scheduler.schedule()
        self.metrics.preemptions += len(batch.preempted)
        for seq in batch.preempted:
            seq.preemptions += 1
        outputs = []
        if batch:
            started = self.clock()
            chunks = _traced_chunks(batch)  # before the step counts them computed
            logits = self.runner.execute(batch)
            ended = self.clock()
            if self.drafter is not None:  # what a token costs a step: whether drafts pay
                self.drafter.cost.record(batch.num_tokens, ended - started)
            for seq, n in chunks:
                seq.chunk_times.append((started, ended, n))  # type: ignore[union-attr]
            outputs = self._finish_step(batch, logits)
            self.metrics.steps += 1
        self._emit_events()
        if self.store is not None:  # what this step released, copied behind it
            self.store.after_step(self.kv)
        return outputs

    def expire_retention(self) -> float | None:
        """Release the sessions' pins past their TTL (steps do it too; the replica's loop
        calls this while the engine is idle); seconds until the next goes (None: none)."""
        wait = self.block_manager.pins.expire()
        if self.store is not None:  # the released blocks spill like any others
            self.store.after_step(self.kv)
        return wait

    def generate(
        self,
        prompts: abc.Sequence[abc.Sequence[int]],
        params: SamplingParams | abc.Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts that arrive together to completion; outputs in input order (choice 0
        of a request with ``n`` > 1: ``generate_choices`` gives them all)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        batch_id = next(self._ids)
        ids = [f"generate-{batch_id}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p, cache_salt)
        results: dict[tuple[str, int], RequestOutput] = {}
        wanted = sum(p.n for p in params)
        while len(results) < wanted:
            results |= {(o.request_id, o.index): o for o in self.step() if o.finished}
        return [results[rid, 0] for rid in ids]

    def generate_choices(
        self, prompt: abc.Sequence[int], params: SamplingParams
    ) -> list[RequestOutput]:
        """Run one prompt with ``params.n`` choices to completion; outputs by choice."""
        rid = f"choices-{next(self._ids)}"
        self.add_request(rid, prompt, params)
        results: dict[int, RequestOutput] = {}
        while len(results) < params.n:
            results |= {o.index: o for o in self.step() if o.finished and o.request_id == rid}
        return [results[i] for i in range(params.n)]

    # -- cache events and introspection -----------------------------------------------------

    def attach_store(self, store: SecondTier) -> None:
        """Use ``store`` as this engine's second cache tier (before the first request)."""
        if self.kv is None or self.has_unfinished_requests():
            raise ValueError("a store needs a KV pool and an engine that has served nothing")
        store.attach(self.kv)
        self.store = store

    def subscribe(self, listener: Callable[[CacheEvents], None]) -> None:
        """Call ``listener`` once per step that published or evicted block hashes."""
        self._listeners.append(listener)

    def cached_block_hashes(self) -> set[bytes]:
        """Every block hash held now (for an index to resynchronise from)."""
        cache = self.block_manager.prefix_cache
        return cache.cached_hashes() if cache is not None else set()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Refused (False) while requests hold blocks."""
        if not self.block_manager.reset_prefix_cache():
            return False
        self._emit_events()
        return True

    def stats(self, latencies: bool = True) -> EngineStats:
        """Counters and block accounting; with ``latencies``, also TTFT and ITL percentiles
        (sorting up to 100k samples: leave them out where a snapshot is taken often)."""
        return EngineStats.collect(self.metrics, self.scheduler, latencies)

    def check_invariants(self, idle: bool = False) -> None:
        """Raise ``AssertionError`` unless the block accounting adds up (see
        ``replica.engine.blocks.audit``); with ``idle`` (no request left), also unless no block is
        in use. Tests call this after every step; replicas whenever idle."""
        sched = self.scheduler
        check_block_accounting(self.block_manager, sched.running, sched.waiting)
        pinned = len(set(self.block_manager.pins.blocks()))
        if idle and self.block_manager.allocator.num_in_use != pinned:
            raise AssertionError("blocks still in use with no request left (besides pins)")

    # -- internals --------------------------------------------------------------------------

    def _finish_step(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[RequestOutput]:
        """Account what the step computed and sample where a chunk reached the last token
        (its row is the last of its logits rows; earlier ones are prompt logprobs)."""
        rows = logits.split(batch.logit_rows)
        sampled = [i for i, sample in enumerate(batch.samples) if sample and not batch.drafts[i]]
        last_rows = torch.stack([rows[i][-1] for i in sampled]) if sampled else logits[:0]
        samples = self.sampler.sample_each(last_rows, [batch.seqs[i].sample_row() for i in sampled])
        for seq, n, own, drafts in zip(
            batch.seqs, batch.num_new_tokens, rows, batch.drafts, strict=True
        ):
            n -= len(drafts)  # a draft counts once verification keeps it (``_verify``)
            self.metrics.computed_tokens += n
            seq.record_prompt_logprobs(own, n)
            seq.num_computed_tokens += n
        now = self.clock()
        outputs = [
            self._verify(batch.seqs[i], rows[i], drafts, now)
            for i, drafts in enumerate(batch.drafts)
            if drafts
        ]
        for i, sample in zip(sampled, samples, strict=True):
            seq = batch.seqs[i]
            first_of_many = seq.params.n > 1 and seq.num_output_tokens == 0
            try:
                if isinstance(sample, Exception):
                    raise sample
                outputs.append(self._advance(seq, sample, now))
                if first_of_many:
                    outputs += self._fork_choices(seq, rows[i][-1], now)
            except Exception as exc:  # one request's failure, never the step's
                outputs.append(self._fail(seq, exc))
        return outputs

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """Drop ``seq`` (its blocks freed, like an abort) after a failure of its own, and
        say so in its output (``finish_reason`` "error"); the step goes on for the rest."""
        log.error("request %s failed in the engine", seq.request_id, exc_info=exc)
        self.metrics.failed_requests += 1
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
        return seq.output([], error=f"{type(exc).__name__}: {exc}")

    def _fork_choices(self, parent: Sequence, row: torch.Tensor, now: float) -> list[RequestOutput]:
        """Choices 1..n-1 of ``parent``, from its one prefill (``replica.engine.choices``)."""
        outputs = []
        for child, sample in fork_choices(parent, row, self.sampler, self.scheduler):
            self._seqs[child.request_id] = child
            self._choices.setdefault(parent.request_id, []).append(child.request_id)
            outputs.append(self._advance(child, sample, now))
        return outputs

    def _verify(
        self, seq: Sequence, rows: torch.Tensor, drafts: list[int], now: float
    ) -> RequestOutput:
        """A decode with drafts (``replica.engine.speculation``): the tokens plain decoding
        picks, as many as the drafts confirmed plus one; the KV of rejected drafts rolled
        back, the blocks the kept ones filled published."""
        try:
            verified = verify(seq, rows, drafts, self.sampler, self._eos_token_ids)
        except Exception as exc:  # one request's failure, never the step's
            return self._fail(seq, exc)
        m = self.metrics
        beyond_one = len(verified.samples) - 1  # the decode token was counted already
        seq.num_computed_tokens += beyond_one
        m.computed_tokens += beyond_one
        m.draft_tokens += len(drafts)
        m.accepted_draft_tokens += verified.accepted
        m.draft_steps_saved += beyond_one
        if seq.drafts is not None and self.drafter is not None:
            self.drafter.record(seq.drafts, len(drafts), verified.accepted)
        self.block_manager.settle_drafts(seq)
        return self._emitted(seq, verified.samples, now)

    def _advance(self, seq: Sequence, sample: Sample, now: float) -> RequestOutput:
        """Commit one sampled token to ``seq``; its output."""
        seq.finish_reason = seq.commit(sample.token_id, self._eos_token_ids)
        return self._emitted(seq, [sample], now)

    def _emitted(self, seq: Sequence, samples: list[Sample], now: float) -> RequestOutput:
        """``seq`` committed ``samples`` this step: count them, end it if they finished it,
        and its output."""
        m = self.metrics
        m.generation_tokens += len(samples)
        if seq.first_token_time is None:  # first step of this request: its prompt is done
            m.prompt_tokens += seq.num_prompt_tokens
            m.cached_prompt_tokens += seq.num_cached_prompt_tokens or 0
            seq.first_token_time = now
            m.ttft_s.append(now - seq.arrival_time)
        elif seq.last_token_time is not None:  # (a forked choice's first token has none)
            m.itl_s.append(now - seq.last_token_time)
        seq.last_token_time = now
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
            self.block_manager.retain(seq)  # before its blocks go: a pin shares them
            self.scheduler.remove(seq)
            del self._seqs[seq.request_id]
            m.num_finished += 1
        logprobs = [s.logprob for s in samples if s.logprob is not None] or None
        return seq.output([s.token_id for s in samples], logprobs)

    def _emit_events(self) -> None:
        cache = self.block_manager.prefix_cache
        events = cache.drain_events() if cache is not None else None
        if events is not None:
            for listener in self._listeners:
                listener(events)


def _traced_chunks(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
    """The traced sequences of ``batch`` computing part of their prompt, with how much."""
    return [
        (seq, n)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        if seq.chunk_times is not None and seq.num_computed_tokens < seq.num_prompt_tokens
    ]
