"""The simulator at a real run's speed (``bench.sim.pace``): the scaled cost model, the
factor, and the search that finds it against a probe whose ITL is not proportional."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.sim.cost_model import CostModel
from bench.sim.pace import SCALED, matched, real_itls, scaled, speed_factor

COST = CostModel(0.007, 4.7e-4, 1.9e-3, "a host", 0.01, 2e-5, "pulls", 1.4e-4)


def test_every_engine_side_time_scales_and_the_model_says_so() -> None:
    slow = scaled(COST, 2.0)
    for name in SCALED:
        assert getattr(slow, name) == pytest.approx(2 * getattr(COST, name)), name
    assert slow.measured.startswith("a host") and "x2.000" in slow.measured
    with pytest.raises(ValueError):
        scaled(COST, 0.0)


def test_the_factor_is_the_median_ratio_over_the_policies_in_both() -> None:
    real = {"a": 0.02, "b": 0.03, "c": 0.01, "only_real": 1.0}
    sim = {"a": 0.01, "b": 0.01, "c": 0.01, "only_sim": 1.0}
    assert speed_factor(real, sim) == pytest.approx(2.0)  # ratios 2, 3, 1
    with pytest.raises(ValueError, match="no policy ran in both"):
        speed_factor({"a": 1.0}, {"b": 1.0})


def _results(folder: Path, sections: int) -> Path:
    runs = {f"rate {i}/s": {"p": {"itl_p50_s": 0.02}, "q": {"error": "x"}} for i in range(sections)}
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"runs": runs}))
    return folder


def test_a_real_run_gives_its_policies_itls_and_must_have_one_rate(tmp_path: Path) -> None:
    assert real_itls(_results(tmp_path / "one", 1)) == {"p": 0.02}
    assert real_itls(tmp_path / "one" / "results.json") == {"p": 0.02}
    with pytest.raises(ValueError, match="2 sections"):
        real_itls(_results(tmp_path / "two", 2))


def test_the_search_finds_the_factor_of_a_superlinear_itl(tmp_path: Path) -> None:
    """A probe whose ITL grows as the factor to the 1.6 (slower engines batch more), in
    steps of 0.5 ms (steps come whole): a proportional correction overshoots, the search
    brackets and bisects, and keeps the closest probe."""
    real = _results(tmp_path / "real", 1)  # 0.02 s
    seen: list[float] = []

    def probe(cost: CostModel) -> dict[str, dict[str, float]]:
        factor = cost.base_s / COST.base_s
        seen.append(factor)
        itl = round(0.008 * factor**1.6 / 5e-4) * 5e-4
        return {"p": {"itl_p50_s": itl}, "q": {"itl_p50_s": 0.5}}

    cost, record = matched(COST, real, probe, probes=8, within=0.03)
    exact = (0.02 / 0.008) ** (1 / 1.6)
    assert abs(math.log(record["factor"] / exact)) < 0.05, (record, exact)
    assert cost.base_s == pytest.approx(COST.base_s * record["factor"])
    assert seen[0] == 1.0 and len(seen) == len(record["probes"]) <= 8
    kept = min(record["probes"], key=lambda t: abs(math.log(t["off_by"])))
    assert kept["factor"] == record["factor"]
    assert seen[1] == pytest.approx(0.02 / 0.008)  # first a proportional step: too slow
