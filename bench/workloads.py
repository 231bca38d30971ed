"""Seeded, reproducible request traces shared by benchmarks, experiments and the simulator.

A trace is a list of ``TraceRequest`` with open-loop Poisson arrival times: arrivals do not
wait for the server, as real traffic does not. Prompts are text, so one trace can be sent over
HTTP, tokenized for the offline engine (``TraceRequest.token_ids``, with the model's own
tokenizer), or simulated. Traces save to and load from JSONL, one request per line.

Workloads:

* ``chat``: one shared system prompt, a unique question per request.
* ``assistant``: real text for the real model: a support assistant's ~600-token system
  prompt and real short questions, sent as chats (the model's chat template).
* ``multi_tenant``: ``tenants`` system prompts with Zipf popularity (``zipf`` exponent).
* ``multi_turn``: conversations whose every turn resends the growing history.
* ``random``: no shared text at all (the control: prefix routing must not invent savings).
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.assistant_prompts import SUPPORT_QUESTIONS, SUPPORT_SYSTEM_PROMPT
from kvindex.hashing import BlockHasher
from replica.checkpoints.tokenizer import Tokenizer
from replica.config import EngineConfig

_WORDS = tuple(
    "the a assistant user answer question always never please tool call result json "
    "format reply short long careful polite safety policy context document summary "
    "translate explain code python function error retry search weather city price order "
    "account refund shipping date time number list table step plan check verify cite "
    "source memory history turn message system role content stream token cache prefix".split()
)


@dataclass(frozen=True)
class TraceRequest:
    """One request: when it arrives, its prompt text, how much it may generate."""

    request_id: str
    arrival_s: float
    prompt: str  # the completion prompt, or the user's message when ``system`` is set
    max_tokens: int
    group: str = ""  # the shared prefix it carries: tenant or conversation ("" for none)
    system: str = ""  # set: a chat request (system prompt + ``prompt``), rendered by the
    # model's chat template

    def token_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt as the engine gets it (through the chat template for a chat)."""
        if not self.system:
            return tokenizer.encode(self.prompt)
        messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.prompt},
        ]
        return tokenizer.encode_chat(tokenizer.render_chat(messages))


@dataclass(frozen=True)
class WorkloadSpec:
    """Every knob of every workload (each workload reads the ones it needs)."""

    workload: str = "chat"
    num_requests: int = 64
    rate: float = 8.0  # Poisson arrivals per second
    seed: int = 7
    system_chars: int = 600
    question_chars: tuple[int, int] = (40, 120)
    output_tokens: tuple[int, int] = (16, 48)
    tenants: int = 16
    zipf: float = 1.1
    conversations: int = 8
    answer_chars: tuple[int, int] = (60, 160)
    max_history_chars: int = 3000  # a longer conversation starts over (a new one)


def make_trace(spec: WorkloadSpec) -> list[TraceRequest]:
    try:
        build = _WORKLOADS[spec.workload]
    except KeyError:
        known = sorted(_WORKLOADS)
        raise ValueError(f"unknown workload {spec.workload!r}; one of {known}") from None
    return build(spec)


def chat_trace(spec: WorkloadSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    system = system_prompt(spec.seed, "system", spec.system_chars)
    times = _arrivals(rng, spec.num_requests, spec.rate)
    return [
        TraceRequest(
            request_id=f"chat-{i}",
            arrival_s=times[i],
            prompt=f"{system}\nUser {i}: {filler_text(rng, rng.randint(*spec.question_chars))}?",
            max_tokens=rng.randint(*spec.output_tokens),
            group="system",
        )
        for i in range(spec.num_requests)
    ]


def multi_tenant_trace(spec: WorkloadSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    weights = [1.0 / (k + 1) ** spec.zipf for k in range(spec.tenants)]
    cumulative = list(itertools.accumulate(weights))
    systems: dict[int, str] = {}
    times = _arrivals(rng, spec.num_requests, spec.rate)
    trace = []
    for i in range(spec.num_requests):
        tenant = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
        if tenant not in systems:
            systems[tenant] = system_prompt(spec.seed, f"tenant-{tenant}", spec.system_chars)
        question = filler_text(rng, rng.randint(*spec.question_chars))
        trace.append(
            TraceRequest(
                request_id=f"tenant-{tenant}-{i}",
                arrival_s=times[i],
                prompt=f"{systems[tenant]}\nUser {i}: {question}?",
                max_tokens=rng.randint(*spec.output_tokens),
                group=f"tenant-{tenant}",
            )
        )
    return trace


def multi_turn_trace(spec: WorkloadSpec) -> list[TraceRequest]:
    """Each arrival is the next turn of one of ``conversations`` live conversations: the whole
    history so far (system prompt, earlier questions and answers) plus a new question. A
    conversation longer than ``max_history_chars`` is replaced by a new one."""
    rng = random.Random(spec.seed)
    system = system_prompt(spec.seed, "assistant", spec.system_chars)
    ids = itertools.count()

    def new_conversation() -> tuple[int, str, int]:
        cid = next(ids)
        return cid, f"{system}\nConversation {cid}.", 0

    slots = [new_conversation() for _ in range(spec.conversations)]
    times = _arrivals(rng, spec.num_requests, spec.rate)
    trace = []
    for i in range(spec.num_requests):
        slot = rng.randrange(spec.conversations)
        cid, history, turn = slots[slot]
        question = filler_text(rng, rng.randint(*spec.question_chars))
        prompt = f"{history}\nUser: {question}?\nAssistant:"
        trace.append(
            TraceRequest(
                request_id=f"conv-{cid}-turn-{turn}",
                arrival_s=times[i],
                prompt=prompt,
                max_tokens=rng.randint(*spec.output_tokens),
                group=f"conv-{cid}",
            )
        )
        # the client resends the answer it got; the trace fixes its text in advance
        history = f"{prompt} {filler_text(rng, rng.randint(*spec.answer_chars))}."
        slots[slot] = (cid, history, turn + 1)
        if len(history) > spec.max_history_chars:
            slots[slot] = new_conversation()
    return trace


def assistant_trace(spec: WorkloadSpec) -> list[TraceRequest]:
    """Chats with a real support assistant: one ~600-token system prompt (in SmolLM2's
    tokens), real short questions, ``output_tokens`` each (for the real model)."""
    rng = random.Random(spec.seed)
    times = _arrivals(rng, spec.num_requests, spec.rate)
    return [
        TraceRequest(
            request_id=f"assistant-{i}",
            arrival_s=times[i],
            prompt=f"{rng.choice(SUPPORT_QUESTIONS)} (ticket {i})",
            max_tokens=rng.randint(*spec.output_tokens),
            group="support",
            system=SUPPORT_SYSTEM_PROMPT,
        )
        for i in range(spec.num_requests)
    ]


def random_trace(spec: WorkloadSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.?"
    low, high = spec.question_chars
    length = (spec.system_chars + low, spec.system_chars + high)
    times = _arrivals(rng, spec.num_requests, spec.rate)
    return [
        TraceRequest(
            request_id=f"random-{i}",
            arrival_s=times[i],
            prompt="".join(rng.choice(alphabet) for _ in range(rng.randint(*length))),
            max_tokens=rng.randint(*spec.output_tokens),
        )
        for i in range(spec.num_requests)
    ]


_WORKLOADS = {
    "chat": chat_trace,
    "assistant": assistant_trace,
    "multi_tenant": multi_tenant_trace,
    "multi_turn": multi_turn_trace,
    "random": random_trace,
}
WORKLOADS = tuple(_WORKLOADS)


def save_trace(path: str | Path, trace: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for req in trace:
            f.write(json.dumps(asdict(req)) + "\n")


def load_trace(path: str | Path) -> list[TraceRequest]:
    with open(path) as f:
        return [TraceRequest(**json.loads(line)) for line in f if line.strip()]


def oracle_hit_rate(
    trace: Sequence[TraceRequest], hasher: BlockHasher, tokenizer: Tokenizer
) -> float:
    """The fraction of prompt tokens an infinite single cache would serve: full prompt
    blocks seen before (in arrival order), at least one token always recomputed. No
    routing policy on any number of replicas can do better on this trace."""
    seen: set[bytes] = set()
    cached = total = 0
    for req in sorted(trace, key=lambda r: r.arrival_s):
        ids = req.token_ids(tokenizer)
        chain = hasher.chain(ids)
        hits = next((i for i, h in enumerate(chain) if h not in seen), len(chain))
        cached += min(hits, (len(ids) - 1) // hasher.block_size) * hasher.block_size
        total += len(ids)
        seen.update(chain)
    return cached / total if total else 0.0


def system_prompt(seed: int, name: str, num_chars: int) -> str:
    rng = random.Random(f"{seed}/{name}")
    return f"System ({name}): you are a careful assistant. {filler_text(rng, num_chars)}"


def filler_text(rng: random.Random, num_chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < num_chars:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:num_chars]


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def fast_engine(model: str, **fields: Any) -> EngineConfig:
    """The engine of the routing, simulation and fault experiments: one thread, float32 and a
    512-token step budget (what their README tables were measured with), ``fields`` on top."""
    base = {"model": model, "dtype": "float32", "num_threads": 1, "max_num_batched_tokens": 512}
    return EngineConfig(**{**base, **fields})
