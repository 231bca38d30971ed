"""The simulator at the speed a real run had: its cost model scaled so that the simulated
decode inter-token latency matches the real run's (``simulate --speed-of``).

Why: a policy that reads load (``cache_aware``'s bounded load, any spill) places requests by
how many are in flight when each arrives, and that count follows the engines' speed against
the arrival rate. The stored calibration is one host's, alone; a real run on a faster host,
or beside another busy process, has more or fewer requests in flight at the same arrival
times. Measured (docs/results.md, "The simulator at the real run's speed"): the real
cluster with a CPU hog beside it ran ~2x slower and ``cache_aware``'s hit rate fell from
0.44-0.52 to 0.38-0.42 while the simulator, at its calibration, stayed at 0.49.

The inter-token latency is the speed measure because both sides report it for every
policy and it is mostly engine time (a decode step), little routing or queueing. The
factor is searched for (``matched``) by the median over the policies both ran of real ITL
p50 / simulated ITL p50; every engine-side time (step, pull, restore) scales by it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.sim.cost_model import CostModel

# every engine-side time: a step, a pull, a restore from the node store
SCALED = (
    "base_s",
    "prefill_token_s",
    "decode_seq_s",
    "pull_call_s",
    "pull_block_s",
    "store_block_s",
)


def scaled(cost: CostModel, factor: float) -> CostModel:
    """``cost`` with every engine-side time multiplied by ``factor`` (> 0)."""
    if not factor > 0:
        raise ValueError(f"a speed factor must be positive, not {factor}")
    fields = {name: getattr(cost, name) * factor for name in SCALED}
    note = f"{cost.measured}; scaled x{factor:.3f} to a real run's ITL"
    return dataclasses.replace(cost, **fields, measured=note)


def real_itls(results: Path) -> dict[str, float]:
    """Policy -> ITL p50 (s) in a routing run's ``results.json`` (a file or its folder),
    from its one section (a trace file's replay has one rate)."""
    path = results / "results.json" if results.is_dir() else results
    payload = json.loads(path.read_text())
    sections = list(payload["runs"].values())
    if len(sections) != 1:
        raise ValueError(f"{path}: {len(sections)} sections; --speed-of needs a one-rate run")
    return _itls(sections[0])


def _itls(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    return {p: float(m["itl_p50_s"]) for p, m in runs.items() if m.get("itl_p50_s")}


def speed_factor(real: Mapping[str, float], simulated: Mapping[str, float]) -> float:
    """The median over the policies in both of real / simulated ITL p50."""
    common = sorted(set(real) & set(simulated))
    if not common:
        both = f"real {sorted(real)}, simulated {sorted(simulated)}"
        raise ValueError(f"no policy ran in both: {both}")
    return statistics.median(real[p] / simulated[p] for p in common)


def matched(
    cost: CostModel,
    real: Path,
    probe: Callable[[CostModel], Mapping[str, Mapping[str, Any]]],
    probes: int = 5,
    within: float = 0.03,
) -> tuple[CostModel, dict[str, Any]]:
    """``cost`` scaled to the real run in ``real``; ``probe`` simulates the policies at a
    cost model and returns policy -> metrics. The ITL neither scales in proportion (slower
    engines batch more, so each step is longer still) nor smoothly (it moves in steps), so
    the factor is searched: scaled by the ratio until a too-fast and a too-slow factor are
    found, then bisected (geometrically) between them, at most ``probes`` simulations,
    stopping ``within`` of the real ITL. The probe closest to it is the one kept; the
    report gets every probe."""
    target = real_itls(real)
    factor, tried = 1.0, []
    fast, slow = 0.0, float("inf")  # factors known to simulate too fast / too slow
    for _ in range(probes):
        ratio = speed_factor(target, _itls(probe(scaled(cost, factor))))
        tried.append({"factor": factor, "off_by": ratio})
        if abs(ratio - 1) <= within:
            break
        fast, slow = (max(fast, factor), slow) if ratio > 1 else (fast, min(slow, factor))
        bracketed = fast > 0 and slow < float("inf")
        factor = math.sqrt(fast * slow) if bracketed else factor * ratio
    best = min(tried, key=lambda t: abs(math.log(t["off_by"])))
    record = {"factor": best["factor"], "real_itl_p50_s": target, "probes": tried}
    return scaled(cost, best["factor"]), record
