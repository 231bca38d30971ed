"""What tenants and agents send, for the tenants and sessions experiments: one tenant's
open-loop requests (cached or not), and agent sessions that grow by a tool result a turn."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.workloads import TraceRequest, filler_text, system_prompt


def tenant_trace(
    tenant: str,
    rate: float,
    duration_s: float,
    seed: int,
    cached: bool,
    max_tokens: int = 24,
    variant: str = "",
) -> list[TraceRequest]:
    """One tenant's open-loop requests for ``duration_s`` seconds: ``cached``, its own
    ~1,200-character system prompt and a short question (the prompt is served from cache
    after the first); else ~1,200 characters of text of its own each (nothing cached).
    Another ``variant`` gives other questions (and arrivals) under the same system prompt:
    one phase does not replay another's requests, whose every full block would be cached."""
    # no variant: the seed string the traces of earlier runs were drawn from, unchanged
    rng = random.Random(f"{seed}/{tenant}/{rate}/{cached}" + (f"/{variant}" if variant else ""))
    system = system_prompt(seed, f"tenant-{tenant}", 1200)
    times = []
    t = rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    trace = []
    for i, arrival in enumerate(times):
        question = filler_text(rng, rng.randint(60, 120))
        prompt = f"{system}\nUser {i}: {question}?" if cached else filler_text(rng, 1200)
        trace.append(TraceRequest(f"{tenant}-{i}", arrival, prompt, max_tokens, tenant))
    return trace


@dataclass(frozen=True)
class AgentTurn:
    """One turn of an agent session: sent ``wait_s`` after the previous answer (the tool
    it ran), its prompt the whole session so far."""

    request: TraceRequest
    wait_s: float


def agent_sessions(
    sessions: int,
    turns: int,
    tool_wait_s: tuple[float, float],
    seed: int,
    max_tokens: int = 24,
) -> list[list[AgentTurn]]:
    """``sessions`` agent conversations of ``turns`` turns: a system prompt of its own
    (~800 characters: the agent's tools and task), then per turn the model's answer (its text
    fixed in advance, as the client resends it) and a tool result (~400-800 characters)
    appended; between turns the tool runs for a uniform ``tool_wait_s`` seconds. The first
    turns start over the first 10 s."""
    rng = random.Random(f"agents/{seed}")
    out = []
    for s in range(sessions):
        history = system_prompt(seed, f"agent-{s}", 800) + f"\nTask: {filler_text(rng, 120)}."
        session = []
        for t in range(turns):
            prompt = f"{history}\nAssistant:"
            wait = rng.uniform(0, 10) if t == 0 else rng.uniform(*tool_wait_s)
            request = TraceRequest(f"agent-{s}-turn-{t}", 0.0, prompt, max_tokens, f"agent-{s}")
            session.append(AgentTurn(request, wait))
            answer, tool = filler_text(rng, 150), filler_text(rng, rng.randint(400, 800))
            history = f"{prompt} {answer}.\nTool result: {tool}."
        out.append(session)
    return out
