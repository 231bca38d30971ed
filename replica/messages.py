"""What the ingress sends an engine replica and what it streams back (no torch, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvindex.records import RoutingRequest
from replica.sampling.params import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Retention:
    """Keep a finished request's blocks for its session's next turn (``replica.engine.blocks.
    retention``): ``session`` names the conversation (qualified by tenant at the ingress, so
    two tenants' ids never meet), ``ttl_s`` how long (already capped by the tenant's bound;
    0 releases the session's blocks: its last turn)."""

    session: str
    tenant: str
    ttl_s: float

    def __post_init__(self) -> None:
        if not self.session or self.ttl_s < 0:
            raise ValueError("a retention needs a session and a TTL of at least 0")


@dataclass(frozen=True)
class Owner:
    """Whose request it is, as the engine needs to know: its tenant ("": a cluster without
    tenants) and the tenant's weight, whose share of the pool its blocks count in once it
    releases them (``replica.engine.blocks.eviction``), and its priority (a prompt of a
    higher priority is computed before those of lower ones: ``replica.engine.scheduler``)."""

    tenant: str = ""
    weight: float = 1.0
    priority: int = 0

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError("a tenant's weight must be positive")


@dataclass(frozen=True)
class EngineTimes:
    """Where a traced request's time went inside the engine, on the engine's clock
    (``time.monotonic`` seconds of the replica's process): added, then its node-store
    restore (``restore_s``), first scheduled, each prompt chunk (start, end, tokens), first
    token, finished. Sent with a traced request's last output (``EngineRequest.trace_parent``)
    for the replica's spans (``replica.trace_spans``); nothing is timed for other requests."""

    arrival: float
    restore_s: float
    scheduled: float | None
    chunks: tuple[tuple[float, float, int], ...]
    first_token: float | None
    finished: float
    preemptions: int


@dataclass(frozen=True)
class EngineRequest:
    """One tokenized request. The ingress hashes the prompt once; the request router reads
    ``route`` (and Ray's own prefix router reads ``prompt``). A request resumed after its
    replica died carries the tokens it already delivered in ``output_token_ids`` (then the
    route's chain covers prompt and those tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    route: RoutingRequest
    cache_salt: str | None = None
    prompt: str = ""
    output_token_ids: list[int] = field(default_factory=list)  # resuming: already delivered
    retention: Retention | None = None  # keep its blocks for the session's next turn
    owner: Owner = Owner()  # its tenant's share of the pool
    trace_parent: str | None = None  # W3C traceparent of the ingress's call: it is traced
    prefer_replica_id: str | None = None  # moved here: the replica its KV was pushed to


@dataclass(frozen=True)
class Move:
    """A stream this replica stopped so that another continues it (``replica.moves``): the
    replica its KV (prompt and output so far) went to (None: the push failed or found no
    replica, and the next one recomputes it), the tokens and bytes pushed, the seconds it
    took, and why (``leaving``, ``balance``, ``operator``)."""

    target: str | None
    tokens: int
    num_bytes: int
    seconds: float
    reason: str


@dataclass(frozen=True)
class RequestOutput:
    """One choice's progress after an engine step: the tokens new in this step and all so far.

    ``request_id`` and ``index`` name the choice (a request with ``n`` > 1 has choices
    0..n-1). ``finish_reason`` is ``"stop"`` (EOS or a stop token), ``"length"``
    (``max_tokens``), ``"abort"``, or ``"error"`` (the engine dropped it: ``error`` says why,
    ``RequestFailedError``). ``num_cached_tokens`` counts prompt tokens served from
    the prefix cache. A replica streams outputs as they are (``streamed``), with its id.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]  # every output token so far (left behind when streamed)
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    index: int = 0  # which of the request's n choices
    logprobs: list[TokenLogprob] | None = None  # of ``new_token_ids``, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only, if asked
    replica_id: str = ""  # set by the replica that streamed it
    error: str | None = None  # finish_reason "error": what failed
    num_restored_tokens: int = 0  # of num_cached_tokens: restored from the node store
    num_pulled_tokens: int = 0  # of num_cached_tokens: pulled from another replica
    times: EngineTimes | None = None  # a traced request's last output: where its time went
    moved: Move | None = None  # the stream's last output here: it goes on elsewhere

    def streamed(self, replica_id: str) -> RequestOutput:
        """This output as a replica sends it: with its id, and without the cumulative
        ``token_ids`` (a stream that carried them would grow quadratically; the receiver
        has the new tokens of every output)."""
        return replace(self, token_ids=[], replica_id=replica_id)


@dataclass(frozen=True)
class PullRequest:
    """A replica asking another for the verified cached prefix of a prompt
    (``replica.kv.transfer``); routed to ``target_replica_id`` and nowhere else."""

    target_replica_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    node_id: str | None = None  # the requester's Ray node: same node, read the pool itself


@dataclass(frozen=True)
class KVPush:
    """KV one replica hands another (``replica.moves``): a moved stream's prompt and output,
    or a leaving replica's hot prefix. Routed to ``target_replica_id`` when set, else like
    an engine request for ``route`` (where the router would send that prefix next), never
    to ``avoid_replica_id`` (the sender). ``export`` is a ``replica.kv.transfer.
    PrefixExport`` (typed loosely: this module imports no torch)."""

    token_ids: list[int]
    cache_salt: str | None
    export: object
    route: RoutingRequest | None = None
    target_replica_id: str | None = None
    avoid_replica_id: str | None = None


@dataclass(frozen=True)
class MoveOrder:
    """Move streams off ``target_replica_id`` (the replica that runs them): every one, or at
    most ``max_streams`` (longest remaining first), to ``to`` (None: where the router sends
    each); ``reason`` is counted. A push not taken within ``push_timeout_s`` leaves
    that stream to be recomputed where it goes."""

    target_replica_id: str
    to: str | None = None
    max_streams: int | None = None
    reason: str = "operator"
    push_timeout_s: float | None = None  # each push's wait (None: ``moves.push_timeout_s``)
