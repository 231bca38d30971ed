"""What the routing experiment on the real cluster and the simulator share: the policies'
names (``prefill_cost+nostore``, ``+pull``, ``+mirror``) as configs, and the trace options."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.peers.ray_router import CLASS_PATH as TIMED_RAY_DEFAULT
from bench.workloads import (
    WORKLOADS,
    TraceRequest,
    WorkloadSpec,
    fast_engine,
    load_trace,
    make_trace,
)
from replica.checkpoints import SMOLLM2, TINY_MODEL
from replica.config import EngineConfig
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig
from router.config import RayRouting, ServedPolicy, routing_config

POLICIES = ("round_robin", "prefill_cost", "cache_aware", "ray_default", "ray_prefix")


def our_routing(policy: str, epsilon: float, knobs: dict[str, Any]) -> ServedPolicy | RayRouting:
    """The routing section for a policy: ``epsilon`` where the policy has one, ``knobs``
    (routing fields) on top where the section has them, so ``--knobs '{"decode_cost_tokens":
    64}'`` tunes ``prefill_cost`` and leaves round robin beside it as it is
    (``check_knobs`` rejects a knob no policy of the run has); Ray's default router timed
    like ours."""
    fields: dict[str, Any] = {"policy": policy}
    if policy in ("cache_aware", "prefix_affinity"):
        fields["epsilon"] = epsilon
    if policy == "ray_default":
        fields["router_class"] = TIMED_RAY_DEFAULT
    section = routing_config(**fields)
    taken = {k: v for k, v in knobs.items() if k in type(section).model_fields}
    return routing_config(**fields, **taken) if taken else section


def check_knobs(policies: list[str], knobs: dict[str, Any], epsilon: float = 0.25) -> None:
    """Every knob is a field of the routing section of some policy of the run (names read
    as ``split_mirror``, ``split_store`` and ``split_pull`` read them; the simulator's peer
    models have no section): a misspelt knob fails before the first run instead of
    running every policy at its defaults."""
    fields: set[str] = set()
    for policy in policies:
        name = split_pull(split_store(split_mirror(policy)[0])[0])[0]
        try:
            fields |= set(type(our_routing(name, epsilon, {})).model_fields)
        except ValueError:  # not one of our sections (a peer's model)
            continue
    unknown = sorted(set(knobs) - fields)
    if unknown:
        raise ValueError(f"knobs {unknown} are no field of any routing section of {policies}")


def split_variant(name: str, variants: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """``prefill_cost@fit`` -> (``prefill_cost``, the knobs ``--variants`` names ``fit``);
    else (name, {}). One ABBA run then compares knob settings of one policy on one trace."""
    base, at, variant = name.partition("@")
    if not at:
        return name, {}
    if variant not in variants:
        raise ValueError(f"{name}: no variant {variant!r} in --variants ({sorted(variants)})")
    return base, variants[variant]


def json_option(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """A JSON-object option (``--knobs``, ``--variants``) as a dict ({} when not given)."""
    text = getattr(args, name, None)
    return json.loads(text) if text else {}


def run_knobs(args: argparse.Namespace, policy: str) -> tuple[str, dict[str, Any]]:
    """The policy's name without its variant, and the knobs its runs take: ``--knobs``,
    then the variant's on top."""
    name, extra = split_variant(policy, json_option(args, "variants"))
    return name, json_option(args, "knobs") | extra


def check_variants(
    args: argparse.Namespace,
    policies: list[str],
    peer: Callable[[str], bool] = lambda name: False,
) -> None:
    """Before the first run: ``--knobs`` are fields of some policy of the run (``peer``
    names, Ray Serve LLM's apps, are checked by their own runner), each ``@variant`` is
    named in ``--variants`` and its knobs are fields of its own policy."""
    variants = json_option(args, "variants")
    split = [split_variant(p, variants) for p in policies]
    ours = [name for name, _ in split if not peer(name)] or ["prefill_cost"]  # the drop-in's
    check_knobs(ours, json_option(args, "knobs"), args.epsilon)
    for name, extra in split:
        if extra and not peer(name):
            check_knobs([name], extra, args.epsilon)


def split_mirror(name: str) -> tuple[str, bool | None]:
    """``prefill_cost+mirror`` (``+nomirror``) -> (``prefill_cost``, the routers' mirror of
    the index on (off)); else (name, None): ``--index`` or the default decides. Named per
    policy so one ``--repeats`` run alternates the two (ABBA) on one trace."""
    for suffix, mirror in (("+mirror", True), ("+nomirror", False)):
        if name.endswith(suffix):
            return name.removesuffix(suffix), mirror
    return name, None


def split_store(name: str) -> tuple[str, StoreConfig]:
    """``prefill_cost+nostore`` -> (``prefill_cost``, the store off); else the default
    store (on)."""
    if name.endswith("+nostore"):
        return name.removesuffix("+nostore"), StoreConfig(enabled=False)
    return name, StoreConfig()


def split_pull(name: str, pull_json: str | None = None) -> tuple[str, PullConfig | None]:
    """``prefill_cost+pull`` -> (``prefill_cost``, the pull section); else (name, None)."""
    base, plus, suffix = name.partition("+")
    if not plus:
        return name, None
    if suffix != "pull":
        raise ValueError(f"{name}: the only suffix is +pull")
    fields = json.loads(pull_json) if pull_json else {}
    return base, PullConfig.model_validate({**fields, "enabled": True})


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Trace options shared with the simulator."""
    parser.add_argument("--pull", help='the +pull policies\' pull section, e.g. {"min_blocks": 2}')
    parser.add_argument("--workload", choices=WORKLOADS, default="multi_tenant")
    parser.add_argument(
        "--model", default=TINY_MODEL, help="EngineConfig.model (the tiny model is fastest)"
    )
    parser.add_argument("--trace", type=Path, help="replay this JSONL trace instead")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rates", default="4", help="arrival rates per second, comma-separated")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--system-chars", type=int, default=600)
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated; a name@variant runs with --variants' knobs of that variant",
    )
    parser.add_argument(
        "--variants", help='named knob sets, JSON: {"fit": {"decode_cost_tokens": 96}}'
    )
    parser.add_argument("--replicas", default="2")
    parser.add_argument("--epsilon", type=float, default=0.25, help="bounded load factor")
    parser.add_argument(
        "--num-blocks", type=int, default=256, help="KV blocks per replica (small: contended)"
    )
    parser.add_argument(
        "--backend",
        choices=("native", "vllm"),
        default="native",
        help="vllm: vLLM CPU engines from --hf-model, the cluster run from --vllm-python",
    )
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    parser.add_argument("--hf-model", type=Path, default=Path(".models/smollm2-135m-instruct-hf"))
    parser.add_argument("--block-size", type=int, default=None, help="default: 16, vllm 32")


def experiment_engine(args: argparse.Namespace) -> EngineConfig:
    """The engine of every run: ``fast_engine`` of ``--model``, or with ``--backend vllm``
    vLLM's engine of ``--hf-model`` with the same sizes (blocks of 32: vLLM's CPU minimum)."""
    if args.backend == "native":
        fields = {} if args.block_size is None else {"block_size": args.block_size}
        return fast_engine(args.model, num_blocks=args.num_blocks, **fields)
    return fast_engine(
        str(args.hf_model.resolve()),
        backend="vllm",
        model_id=SMOLLM2,
        num_blocks=args.num_blocks,
        block_size=args.block_size or 32,
    )


def traces(args: argparse.Namespace) -> dict[float, list[TraceRequest]]:
    """One trace per arrival rate (or the given trace file, at its own times)."""
    if args.trace is not None:
        return {0.0: load_trace(args.trace)}
    return {
        rate: make_trace(
            WorkloadSpec(
                args.workload,
                num_requests=args.requests,
                rate=rate,
                seed=args.seed,
                system_chars=args.system_chars,
                tenants=args.tenants,
                zipf=args.zipf,
                conversations=args.conversations,
            )
        )
        for rate in (float(r) for r in args.rates.split(","))
    }


def section_name(rate: float) -> str:
    return "trace file" if rate == 0.0 else f"rate {rate:g}/s"
