"""The engines ``speed`` alternates, each behind one interface (``Peer.time``: one batch,
timed inside its run, ``Timing``): ours in this process, transformers, vLLM CPU in its own
virtualenv and process, and this project at an older revision in a process of its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from bench.peers.engine_worker import timed_generate
from bench.peers.engines import (
    TransformersPeer,
    WorkerSession,
    ensure_hf_folder,
    ensure_vllm_venv,
    revision_session,
    vllm_session,
)
from bench.peers.host import vllm_env
from replica.checkpoints import checkpoint_for
from replica.checkpoints.hf import HFFolderCheckpoint
from replica.config import EngineConfig, SpeculationOptions
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams

PEERS = ("ours", "ours-nondet", "transformers", "vllm")


@dataclass(frozen=True)
class Timing:
    """One timed run of prompts submitted together: ``total_s`` until all had finished,
    ``first_s`` until every prompt had its first token, and ``tokens_at_first``, the output
    tokens that existed then (the rest were decoded after it)."""

    total_s: float
    first_s: float
    tokens_at_first: int

    @classmethod
    def of(cls, reply: dict[str, Any]) -> Timing:
        """A worker's reply (``engine_worker.timed_generate``, ``vllm_worker``)."""
        return cls(reply["seconds"][-1], reply["first_s"], reply["tokens_at_first"])

    def decode_rate(self, generated: int) -> float:
        """Tokens/s after the first moment, of ``generated`` output tokens in all."""
        if not 0 < self.first_s < self.total_s or generated <= self.tokens_at_first:
            raise ValueError(f"no decode was timed in {self} of {generated} tokens")
        return (generated - self.tokens_at_first) / (self.total_s - self.first_s)


class Peer(Protocol):
    def time(self, prompts: list[list[int]], max_tokens: int) -> Timing:
        """Generate ``max_tokens`` for every prompt, submitted together, with an empty prefix
        cache, timed."""
        ...

    def close(self) -> None: ...


class EnginePeer:
    """Our engine in this process."""

    def __init__(self, config: EngineConfig, warm: list[int]) -> None:
        self.engine = build_engine(config)
        self.engine.generate([warm], SamplingParams(max_tokens=4))

    def time(self, prompts: list[list[int]], max_tokens: int) -> Timing:
        self.engine.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Timing.of(timed_generate(self.engine, prompts, params))

    def close(self) -> None:
        pass


class HFPeer:
    def __init__(self, peer: TransformersPeer, warm: list[int]) -> None:
        self.peer = peer
        peer.generate([warm], 4)

    def time(self, prompts: list[list[int]], max_tokens: int) -> Timing:
        total_s, first_s = self.peer.generate(prompts, max_tokens)
        return Timing(total_s, first_s, len(prompts))  # a static batch: all first together

    def close(self) -> None:
        pass


class VllmPeer:
    """vLLM CPU in its own virtualenv and process, answering one job at a time."""

    def __init__(self, args: argparse.Namespace, warm: list[int], batches: list[int]) -> None:
        checkpoint = checkpoint_for(args.model)
        folder = (  # a Hugging Face folder as it is; anything else exported once
            checkpoint.folder
            if isinstance(checkpoint, HFFolderCheckpoint)
            else ensure_hf_folder(checkpoint, Path("results") / f"{args.model}-hf")
        )
        spec = {
            "model": str(folder),
            "dtype": args.dtype,
            "threads": args.threads,
            "max_model_len": 4096,
            "max_num_seqs": max(batches),
        }
        log = Path("results") / "speed-vllm.log"
        python = ensure_vllm_venv(args.vllm_venv)
        preload = [name for name in args.vllm_preload.split(",") if name]
        bind = args.vllm_bind == "cores"
        given = vllm_env(python, args.threads, kv_cache_gib=2, preload=preload, bind=bind)
        self.session = vllm_session(python, spec, log, given)
        # what it was given, what its process loaded and bound, what it left in /dev/shm
        self.process: dict[str, Any] = {"given": given, **self.session.started["process"]}
        self.time([warm], 4)

    def time(self, prompts: list[list[int]], max_tokens: int) -> Timing:
        job = {"kind": "generate", "prompts": prompts, "max_tokens": max_tokens, "repeats": 1}
        return Timing.of(self.session.run(job))

    def close(self) -> None:
        self.session.close()
        self.process |= self.session.shm.summary()


class RevisionPeer(VllmPeer):
    """This project's engine at an older revision, in a process of its own."""

    def __init__(
        self, rev: str, args: argparse.Namespace, warm: list[int], batches: list[int]
    ) -> None:
        spec = {
            "model": args.model,
            "dtype": args.dtype,
            "threads": args.threads,
            "num_blocks": 2048,
            "max_num_seqs": max(batches),
            "engine": {"max_num_batched_tokens": args.max_num_batched_tokens},
        }
        log = Path("results") / f"speed-rev-{rev}.log"
        self.session: WorkerSession = revision_session(rev, spec, log)
        self.process: dict[str, Any] = {}
        self.time([warm], 4)


def start_peer(
    name: str, args: argparse.Namespace, prompts: dict[str, Any], batches: list[int]
) -> Peer:
    warm = prompts["chats"][0]

    def ours(deterministic: bool) -> Callable[[], Peer]:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            num_threads=args.threads,
            num_blocks=2048,
            max_num_seqs=max(batches),
            max_num_batched_tokens=args.max_num_batched_tokens,
            deterministic=deterministic,
            # one token per decode step, as every peer here decodes (drafts: bench speculation)
            speculation=SpeculationOptions(enabled=False),
        )
        return lambda: EnginePeer(config, warm)

    starts: dict[str, Callable[[], Peer]] = {
        "ours": ours(True),
        "ours-nondet": ours(False),
        "transformers": lambda: HFPeer(
            TransformersPeer(checkpoint_for(args.model), getattr(torch, args.dtype)), warm
        ),
        "vllm": lambda: VllmPeer(args, warm, batches),
    }
    if name.startswith("rev:"):
        return RevisionPeer(name.removeprefix("rev:"), args, warm, batches)
    if name not in starts:
        raise SystemExit(f"unknown peer {name!r}: choose from {', '.join(PEERS)}, rev:<git rev>")
    return starts[name]()
