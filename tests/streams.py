"""Concurrent streaming chat requests against a real cluster, and killing the busiest replica
mid-stream: what the failover tests share."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench.harness.launcher import ServeCluster


class Stream(threading.Thread):
    """One streaming chat request, read chunk by chunk in its own thread."""

    def __init__(self, base_url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.url = f"{base_url}/v1/chat/completions"
        self.pieces: list[str] = []
        self.usage: dict | None = None
        self.replica = ""
        self.errors: list[dict] = []
        self.logprobs: list[dict] = []  # each token's entry, when the body asks for them

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=300) as resp:
            self.replica = resp.headers["x-replica-id"]
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                elif chunk.get("usage"):
                    self.usage = chunk["usage"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    self.pieces.append(chunk["choices"][0]["delta"]["content"])
                    logprobs = chunk["choices"][0].get("logprobs") or {}
                    self.logprobs += logprobs.get("content") or []


def replica_pids(cluster: ServeCluster, count: int = 2) -> dict[str, int]:
    """Every replica's process id, once Serve has pushed their stats (a stats period)."""
    deadline = time.monotonic() + 60
    while True:
        replicas = cluster.stats()["replicas"]
        if len(replicas) == count and all("pid" in r for r in replicas.values()):
            return {rid: r["pid"] for rid, r in replicas.items()}
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


def chat_bodies(
    model: str, system: str, questions: list[str], sampling: list[dict[str, Any]], **fields: Any
) -> list[dict[str, Any]]:
    """One chat per question under one system prompt, each with its sampling and ``fields``
    (``max_tokens``, ``logprobs``...): output of a set length (``ignore_eos``)."""
    return [
        {
            "model": model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
            "ignore_eos": True,
            **fields,
            **sample,
        }
        for q, sample in zip(questions, sampling, strict=True)
    ]


def streams_with(
    cluster: ServeCluster,
    bodies: list[dict[str, Any]],
    act: Callable[[list[Stream]], None] | None = None,
    min_pieces: int = 5,
) -> list[Stream]:
    """Send every body at once; ``act(streams)`` once each has ``min_pieces`` pieces (all
    mid-generation). Returns the finished streams."""
    streams = [Stream(cluster.base_url, body) for body in bodies]
    for s in streams:
        s.start()
    if act is not None:
        deadline = time.monotonic() + 120
        while min(len(s.pieces) for s in streams) < min_pieces:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        act(streams)
    for s in streams:
        s.join(300)
    return streams


def busiest(streams: list[Stream]) -> str:
    """The replica serving most of ``streams``."""
    replicas = [s.replica for s in streams]
    return max(set(replicas), key=replicas.count)


def run_streams(
    cluster: ServeCluster, bodies: list[dict[str, Any]], kill: bool, min_pieces: int = 5
) -> tuple[list[Stream], str | None]:
    """Send every body at once; with ``kill``, SIGKILL the replica serving most of them once
    every stream has ``min_pieces`` pieces. Returns the finished streams and the victim."""
    pids = replica_pids(cluster)
    victims: list[str] = []

    def sigkill(streams: list[Stream]) -> None:
        victims.append(max(set(pids), key=lambda rid: sum(s.replica == rid for s in streams)))
        os.kill(pids[victims[0]], signal.SIGKILL)

    streams = streams_with(cluster, bodies, sigkill if kill else None, min_pieces)
    return streams, victims[0] if victims else None


def resumed(cluster: ServeCluster) -> float:
    """Streams resumed on another replica so far (the ingress's counter)."""
    text = httpx.get(f"{cluster.base_url}/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("prefix_serve_resumed_requests_total") and "resumed" in line
    )
