"""Rounds of an experiment that compares modes on real clusters: the modes asked for, their
ABBA order, and the Redis and private Ray every round's cluster deploys into."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.harness.launcher import cluster_env
from bench.harness.private_ray import PrivateRay
from bench.harness.redis_server import LocalRedis


def chosen_modes(text: str, allowed: Sequence[str], flag: str = "--modes") -> list[str]:
    """``flag``'s value (comma-separated), each one of ``allowed``."""
    modes = [m for m in text.split(",") if m]
    if not modes or set(modes) - set(allowed):
        raise SystemExit(f"{flag}: choose among {', '.join(allowed)}")
    return modes


def abba(modes: list[str], repeat: int) -> list[str]:
    """The modes in repeat ``repeat``'s order: forward, then backward, and so on."""
    return modes if repeat % 2 == 0 else modes[::-1]


@contextlib.contextmanager
def redis_and_ray(out: Path, env: dict[str, str] | None = None) -> Iterator[tuple[str, PrivateRay]]:
    """A Redis and a private Ray (its log in ``out``; ``env`` added to its processes') for
    every round, stopped after."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(LocalRedis()).url
        ray = PrivateRay(out / "ray.log", dashboard=False)
        stack.callback(ray.stop)
        ray.start(cluster_env() | (env or {}))
        yield url, ray
