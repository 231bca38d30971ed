"""Pull, don't recompute: before a replica admits a request, it asks the index who holds the
longest run of the request's prompt blocks; when another live replica holds at least
``min_blocks`` more of them than this one, it pulls the missing blocks from that replica
(``EngineReplica.export_prefix``, through a Serve handle routed to exactly that replica)
and imports them, verified, before admission (``replica.kv.transfer``). On the same
node the holder answers with where the blocks are in its shared pool and the puller copies
them from there itself (``pull.shared_memory``); otherwise the KV travels through Ray's
object store. The request then hits them like any local prefix, and
``cached_tokens`` counts them.

Nothing waits on a pull for long: the index answers within its own timeout, the pull has
``timeout_s``; a late, failed or refused pull costs a recompute, never an error or a wrong
token. Counted per replica: pulls, blocks and bytes pulled, seconds spent, failed pulls
(timeout, dead or busy holder) and the seconds they waited, refused blocks
(verification), and lookups the index did not answer (Redis down or late: whether a pull
was possible is unknown, and the request recomputes what it lacks).

Known limit: once a replica holds a Serve handle (its first pull), a SIGTERM sent to its
process alone no longer ends it (Ray's handler never runs; the process stays until Serve or
the raylet stops it, and its index entry until its heartbeat lapses). Serve's own stops
(Ctrl-C, scale-down, redeploy) are unaffected. Measured in docs/decisions.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvindex.config import IndexConfig
from kvindex.pulls import pull_source
from kvindex.reader import IndexReader
from kvindex.records import store_id
from replica.engine.engine import Engine
from replica.kv.transfer import import_prefix
from replica.messages import EngineRequest, PullRequest
from replica.pull_config import PullConfig

log = logging.getLogger("ray.serve")


@dataclass
class PullCounters:
    pulls: int = 0
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    pull_seconds: float = 0.0
    pulls_failed: int = 0
    failed_pull_seconds: float = 0.0  # waited on pulls that failed (a recompute followed)
    pulls_shared_memory: int = 0  # of ``pulls``: read from a same-node holder's pool
    pull_blocks_refused: int = 0
    pull_lookups_failed: int = 0  # the index did not answer: no pull was tried

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PullOutcome:
    """One request's pull, for its trace and its reuse ledger: from whom, how many of its
    prompt tokens came in (0: failed or refused), in how long (``time.monotonic`` start)."""

    holder: str
    tokens: int
    started: float
    seconds: float
    failed: bool


class Puller:
    def __init__(
        self,
        engine: Engine,
        run_on_engine: Callable[..., Awaitable[Any]],
        replica_id: str,
        index: IndexConfig,
        config: PullConfig,
        node_id: str | None = None,
    ) -> None:
        self.engine = engine
        self.run_on_engine = run_on_engine  # async (fn, *args): run on the engine's thread
        self.replica_id = replica_id
        self.config = config
        self.node_id = node_id  # a holder on the same node lends its pool by reference
        self.reader = IndexReader(index, engine.config.model_id)
        self.counters = PullCounters()
        self._handle: Any = None

    async def before_admission(self, request: EngineRequest) -> PullOutcome | None:
        """Pull what another replica holds of the request's prefix and this one lacks (None:
        no pull was tried)."""
        route = request.route
        if not self.config.enabled or route is None:
            return None
        if len(route.block_hashes) < self.config.min_blocks:
            return None
        holder = await self._best_holder(route.block_hashes)
        if holder is None:
            return None
        ids = [*request.prompt_token_ids, *request.output_token_ids]
        start = time.monotonic()
        pull = PullRequest(holder, ids, request.cache_salt, self.node_id)
        try:
            export = await asyncio.wait_for(
                self.handle().export_prefix.remote(pull), self.config.timeout_s
            )
        except Exception as exc:  # late, dead or refusing holder: recompute instead
            self.counters.pulls_failed += 1
            self.counters.failed_pull_seconds += time.monotonic() - start
            log.warning("pull from %s failed: %s", holder, type(exc).__name__)
            return PullOutcome(holder, 0, start, time.monotonic() - start, failed=True)
        result = await self.run_on_engine(
            import_prefix, self.engine.kv, ids, request.cache_salt, export
        )
        c = self.counters
        c.pulls += 1
        c.pulls_shared_memory += export.pool is not None
        c.pulled_blocks += result.imported
        c.pulled_bytes += result.imported * (export.num_bytes // max(1, len(export.blocks)))
        c.pull_seconds += time.monotonic() - start
        c.pull_blocks_refused += len(export.blocks) - result.already_held - result.imported
        tokens = result.imported * self.engine.kv.block_size
        return PullOutcome(holder, tokens, start, time.monotonic() - start, failed=False)

    async def _best_holder(self, chain: Sequence[bytes]) -> str | None:
        """The live replica to pull ``chain`` from (``kvindex.pulls.pull_source``), by the
        index's answer, which costs no wait on the engine."""
        answer = await self.reader.aquery(chain)
        if answer is None:  # failed, late, or skipped after recent failures
            self.counters.pull_lookups_failed += 1
            return None
        if not answer:
            return None
        own_store = store_id(self.node_id) if self.node_id else ""
        return pull_source(answer, self.replica_id, self.config.min_blocks, own_store)

    def handle(self) -> Any:
        """This deployment's Serve handle (made at its first use), through which replicas
        reach each other: pulls, and pushes (``replica.moves``)."""
        if self._handle is None:
            from ray import serve

            context = serve.get_replica_context()
            self._handle = serve.get_deployment_handle(
                context.deployment, app_name=context.app_name
            )
        return self._handle
