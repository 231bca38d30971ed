"""Seeded, reproducible request traces shared by benchmarks, experiments and the simulator.

A trace is a list of ``TraceRequest`` with open-loop Poisson arrival times: the arrivals do
not wait for the server, as real traffic does not. Prompts are text, so the same trace can be
sent over HTTP or tokenized for the offline engine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = tuple(
    "the a assistant user answer question always never please tool call result json "
    "format reply short long careful polite safety policy context document summary "
    "translate explain code python function error retry search weather city price order "
    "account refund shipping date time number list table step plan check verify cite "
    "source memory history turn message system role content stream token cache prefix".split()
)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives, what it asks, how much it may generate."""

    request_id: str
    arrival_s: float
    prompt: str
    max_tokens: int
    group: str = ""  # the shared prompt it carries ("" for none)


def _text(rng: random.Random, num_chars: int) -> str:
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


def chat_trace(
    num_requests: int = 64,
    rate: float = 8.0,
    seed: int = 7,
    system_chars: int = 600,
    question_chars: tuple[int, int] = (40, 120),
    output_tokens: tuple[int, int] = (16, 48),
) -> list[TraceRequest]:
    """One shared system prompt (several hundred tokens) and a unique question per request."""
    rng = random.Random(seed)
    system = "System: you are a careful assistant. " + _text(rng, system_chars)
    times = _arrivals(rng, num_requests, rate)
    return [
        TraceRequest(
            request_id=f"chat-{i}",
            arrival_s=times[i],
            prompt=f"{system}\nUser {i}: {_text(rng, rng.randint(*question_chars))}?",
            max_tokens=rng.randint(*output_tokens),
            group="system",
        )
        for i in range(num_requests)
    ]


def random_trace(
    num_requests: int = 64,
    rate: float = 8.0,
    seed: int = 7,
    prompt_chars: tuple[int, int] = (640, 760),
    output_tokens: tuple[int, int] = (16, 48),
) -> list[TraceRequest]:
    """Uniformly random prompts of about the chat trace's length: no shared text at all."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.?"
    times = _arrivals(rng, num_requests, rate)
    return [
        TraceRequest(
            request_id=f"random-{i}",
            arrival_s=times[i],
            prompt="".join(rng.choice(alphabet) for _ in range(rng.randint(*prompt_chars))),
            max_tokens=rng.randint(*output_tokens),
        )
        for i in range(num_requests)
    ]


TRACES = {"chat": chat_trace, "random": random_trace}
